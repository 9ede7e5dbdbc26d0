"""The FastAPI app: /v1 routes and the dev endpoints /sleep, /wake_up, /is_sleeping (and
/start_profile, /stop_profile with observability.profile_dir; /v1/load_lora_adapter,
/v1/unload_lora_adapter with server.allow_runtime_lora_updating) behind the optional API key;
/health, /metrics, /version; the playground at / and the dashboard at /dashboard (web_pages).

Around the routes, outermost first: CORS (when server.cors_origins is set),
RequestIdMiddleware (X-Request-Id in and out), UnhandledErrors (an unexpected
exception is one 500 and the connection stays usable), RequestLimits (body size
and deadline); the chat template and tokenization run on the Preprocessor's
threads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from starlette.types import Message, Scope

from baton import AsyncLLM, __version__
from baton.config import BatonConfig
from baton_openai import __version__ as plugin_version
from baton_openai.batch.lines import LineRunner
from baton_openai.batch.runner import BatchRunner
from baton_openai.endpoints.batches import router as batches_router
from baton_openai.endpoints.chat import router as chat_router
from baton_openai.endpoints.completions import router as completions_router
from baton_openai.endpoints.dev import profile_router
from baton_openai.endpoints.dev import router as dev_router
from baton_openai.endpoints.embeddings import router as embeddings_router
from baton_openai.endpoints.files import router as files_router
from baton_openai.endpoints.lora import LoRARegistry
from baton_openai.endpoints.lora import router as lora_router
from baton_openai.endpoints.messages import router as messages_router
from baton_openai.endpoints.responses import router as responses_router
from baton_openai.endpoints.tokenize import router as tokenize_router
from baton_openai.endpoints.web_pages import install_web_pages
from baton_openai.http.admission import QueueGate
from baton_openai.http.cors import install_cors
from baton_openai.http.errors import install_error_handlers
from baton_openai.http.health import EngineHealth
from baton_openai.http.limits import UPLOAD_OVERHEAD, RequestLimits
from baton_openai.http.openapi import error_responses, install_openapi
from baton_openai.http.request_id import RequestIdMiddleware
from baton_openai.http.unhandled import UnhandledErrors
from baton_openai.metrics.prometheus import PrometheusStatLogger
from baton_openai.parsing.registry import ParserRegistry
from baton_openai.pipeline.context import ServerContext, check_api_key
from baton_openai.protocol.openai import ModelCard, ModelList
from baton_openai.templates.preprocess import Preprocessor

#: /health reports a wedged engine (503) once a health check has gone unanswered this long.
HEALTH_TIMEOUT_S = 10.0

models_router = APIRouter()
ops_router = APIRouter()


@models_router.get("/v1/models", responses=error_responses(401, 500))
async def list_models(raw: Request) -> ModelList:
    ctx = ServerContext.of(raw)
    card = ModelCard(
        id=ctx.model_name, root=ctx.engine.config.model.name, max_model_len=ctx.max_model_len
    )
    adapters = [
        ModelCard(
            id=lora.lora_name,
            root=lora.lora_path,
            parent=ctx.model_name,
            max_model_len=ctx.max_model_len,
        )
        for lora in (ctx.loras.by_name.values() if ctx.loras is not None else ())
    ]
    return ModelList(data=[card, *adapters])


@ops_router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "The engine is alive (empty body)", "content": {}}}
    | error_responses(503),
)
async def health(raw: Request) -> Response:
    await raw.app.state.health.check()  # answers within ~20 ms, even while the engine steps
    return Response(status_code=200)


@ops_router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__, "baton_plugin_openai": plugin_version}


@ops_router.get("/metrics", response_class=PlainTextResponse)
async def metrics(raw: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    logger = ServerContext.of(raw).metrics
    body = generate_latest(logger.registry) if logger is not None else b""
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def find_prometheus_logger(engine: AsyncLLM) -> object | None:
    return next(
        (lg for lg in engine.stat_loggers.loggers if isinstance(lg, PrometheusStatLogger)), None
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The batch worker runs while the app serves (it resumes unfinished batches)."""
    await app.state.batches.start()
    try:
        yield
    finally:
        await app.state.batches.stop()


def build_app(
    engine: AsyncLLM, config: BatonConfig | None = None, parsers: ParserRegistry | None = None
) -> FastAPI:
    """The app around a running AsyncLLM (``config`` defaults to the engine's; ``parsers``:
    the tool-call and reasoning parsers to choose from, by default the installed ones)."""
    cfg = config or engine.config
    srv = cfg.server
    parsers = parsers or ParserRegistry.load()
    app = FastAPI(
        title="baton", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan
    )
    metrics = find_prometheus_logger(engine)
    model_name = srv.served_model_name or cfg.model.name
    loras = None
    if cfg.lora.enable_lora:
        loras = LoRARegistry(model_name, cfg.lora.max_lora_rank)
        for name, path in srv.lora_modules.items():  # checked here; read by the engine in run()
            loras.add(loras.make(name, path))
    app.state.baton = ServerContext(
        engine=engine,
        model_name=model_name,
        max_model_len=engine.info.max_model_len,
        preprocess=Preprocessor(engine, srv),
        api_key=srv.api_key,
        metrics=metrics,
        tool_parser=parsers.tool_parser(srv.tool_call_parser, engine.get_tokenizer()),
        reasoning_parser=parsers.reasoning_parser(srv.reasoning_parser, engine.get_tokenizer()),
        queue=QueueGate(
            srv.max_queued_requests,
            on_reject=(lambda: metrics.count_rejected("queue_full")) if metrics else None,
        ),
        loras=loras,
    )
    app.state.health = EngineHealth(engine, HEALTH_TIMEOUT_S)
    app.state.batches = BatchRunner(
        LineRunner(app, srv.batch_priority),
        files_dir=srv.files_dir,
        max_file_bytes=int(srv.max_file_bytes),
        max_concurrency=srv.batch_max_concurrency,
    )
    install_error_handlers(app)
    install_openapi(app)
    # add_middleware puts each one outside the previous: UnhandledErrors ends up outermost
    app.add_middleware(
        RequestLimits,
        max_bytes=int(srv.max_request_bytes),
        body_timeout=srv.body_timeout,
        # an upload is streamed to disk, not buffered; the multipart framing is allowed for
        uploads={"/v1/files": (int(srv.max_file_bytes) + UPLOAD_OVERHEAD, "server.max_file_bytes")},
    )
    app.add_middleware(UnhandledErrors)
    app.add_middleware(RequestIdMiddleware)
    install_cors(app, srv.cors_origins)
    auth = [Depends(check_api_key)]
    for router in (
        models_router,
        chat_router,
        completions_router,
        embeddings_router,
        messages_router,
        responses_router,
        tokenize_router,
        files_router,
        batches_router,
        dev_router,
    ):
        app.include_router(router, dependencies=auth)
    if cfg.observability.profile_dir:
        app.include_router(profile_router, dependencies=auth)
    if cfg.lora.enable_lora and srv.allow_runtime_lora_updating:
        app.include_router(lora_router, dependencies=auth)
    app.include_router(ops_router)
    install_web_pages(app, cfg, auth)  # the playground at / and /dashboard
    return app


#: A path no route has: a request for it is matched against every route.
_NO_ROUTE = "/.baton/build-routes"


async def build_routes(app: FastAPI) -> None:
    """Have FastAPI build every route's request handling now, before the server listens.

    FastAPI builds an included router's routes (their validators and dependencies) on the first
    request matched against them: ~85 ms of the event loop, paid by whichever request comes
    first (a /health probe waited for it beside four large bodies). A request for a path no route
    has is matched against them all; it goes to the router alone (no middleware, no metrics, no
    log line), its answer to nowhere.
    """
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": _NO_ROUTE,
        "raw_path": _NO_ROUTE.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": None,
        "server": None,
    }

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass  # the 404 goes nowhere

    await app.router(scope, receive, send)
