"""The proxy's HTTP app: /v1/completions and /v1/chat/completions through a producer and a
consumer (``flow``), /health, and /v1/models from a consumer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from baton_openai.http.errors import OpenAIError, install_error_handlers
from baton_openai.pd_proxy.flow import UpstreamError, Upstreams, forwarded, parse_body, relay

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def create_app(upstreams: Upstreams) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await upstreams.aclose()

    app = FastAPI(title="baton pd-proxy", lifespan=lifespan)
    install_error_handlers(app)

    async def generate(request: Request) -> Response:
        path = request.url.path
        body = parse_body(await request.body())
        headers = forwarded(request.headers)
        try:
            params = await upstreams.prefill_params(path, body, headers)
        except UpstreamError as e:
            return Response(e.content, status_code=e.status, media_type="application/json")
        upstream = await upstreams.decode(path, body, params, headers)
        return StreamingResponse(
            relay(upstream),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    for path in GENERATION_PATHS:
        app.add_api_route(path, generate, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        """200 when every engine's /health is."""
        for url in upstreams.prefill_urls + upstreams.decode_urls:
            try:
                ok = (await upstreams.client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                raise OpenAIError(f"{url} is not healthy", status=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = upstreams.decode_urls[0] + "/v1/models"
        try:
            resp = await upstreams.client.get(url, headers=forwarded(request.headers))
        except httpx.HTTPError as e:
            raise OpenAIError(f"the consumer {url} did not answer: {e}", status=502) from None
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    return app
