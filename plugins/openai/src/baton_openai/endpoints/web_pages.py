"""The server's pages: the chat playground at ``/`` (server.playground) and the engine dashboard
at ``/dashboard``, plain HTML/CSS/JS shipped in this distribution (``baton_openai/web``).

The pages and their scripts are public: they hold no data. What they show comes from routes
behind the API key like /v1: ``GET /ui/info`` (the model, plugins, CPU path) and
``GET /ui/stats`` (the engine's figures, polled by the dashboard); the playground talks to
/v1/chat/completions as any client does. The pages ask for the key when a route answers 401 and
send it as ``Authorization: Bearer``. Every file is sent with a Content-Security-Policy that
allows this server's own scripts, styles and connections and nothing else (no inline code, no
other origin, no framing), so the pages work offline and a reply rendered in them cannot run.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request, Response

from baton.config import BatonConfig
from baton_openai.http.errors import OpenAIError
from baton_openai.metrics.dashboard_stats import DashboardStatsSource
from baton_openai.metrics.server_info import ServerInfo, server_info
from baton_openai.pipeline.context import ServerContext

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
#: The files the playground alone uses (not served with server.playground off).
PLAYGROUND_FILES = frozenset({"playground.html", "playground.js"})

pages_router = APIRouter(include_in_schema=False)
data_router = APIRouter(include_in_schema=False)


class WebPages:
    """The shipped files (read once) and the state the data routes answer from."""

    def __init__(self, info: ServerInfo, stats: DashboardStatsSource) -> None:
        self.info = info
        self.stats = stats
        folder = resources.files("baton_openai") / "web"
        self.files = {
            f.name: f.read_bytes()
            for f in folder.iterdir()
            if f.is_file() and any(f.name.endswith(ext) for ext in MEDIA_TYPES)
        }
        if not info.playground:
            self.files = {n: b for n, b in self.files.items() if n not in PLAYGROUND_FILES}

    @classmethod
    def of(cls, request: Request) -> WebPages:
        return request.app.state.web_pages  # type: ignore[no-any-return]

    def serve(self, name: str) -> Response:
        body = self.files.get(name)
        if body is None:
            raise OpenAIError(f"no page or file {name!r} here", 404, code="not_found")
        media_type = next(t for ext, t in MEDIA_TYPES.items() if name.endswith(ext))
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)


def json_response(value: msgspec.Struct) -> Response:
    return Response(
        msgspec.json.encode(value), media_type="application/json", headers=SECURITY_HEADERS
    )


@pages_router.get("/")
async def playground(raw: Request) -> Response:
    return WebPages.of(raw).serve("playground.html")


@pages_router.get("/dashboard")
async def dashboard(raw: Request) -> Response:
    return WebPages.of(raw).serve("dashboard.html")


@pages_router.get("/ui/static/{name}")
async def static_file(raw: Request, name: str) -> Response:
    return WebPages.of(raw).serve(name)


@data_router.get("/ui/info")
async def info(raw: Request) -> Response:
    return json_response(WebPages.of(raw).info)


@data_router.get("/ui/stats")
async def stats(raw: Request) -> Response:
    return json_response(WebPages.of(raw).stats.read())


def install_web_pages(app: FastAPI, config: BatonConfig, auth: list[Any]) -> None:
    """Mount the pages (public) and their data routes (behind ``auth``, the API key check)."""
    ctx: ServerContext = app.state.baton
    metrics = ctx.metrics
    app.state.web_pages = WebPages(
        server_info(config, ctx.model_name, ctx.engine.info),
        DashboardStatsSource(
            metrics.registry if metrics is not None else None,
            metrics.prefix if metrics is not None else "baton_",
        ),
    )
    app.include_router(pages_router)
    app.include_router(data_router, dependencies=auth)
