"""CORS for browser clients: ``server.cors_origins`` through Starlette's CORSMiddleware.

Preflight ``OPTIONS`` requests from an allowed origin are answered (any method,
any request header, so ``Authorization`` and ``X-Request-Id`` pass); other
responses to an allowed origin get ``Access-Control-Allow-Origin`` and expose
``X-Request-Id`` and ``Retry-After``. No credentials mode: an API key travels
in the ``Authorization`` header, not in cookies.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

#: Response headers a browser script may read.
EXPOSED_HEADERS = ("X-Request-Id", "Retry-After")
#: How long a browser may cache a preflight answer (seconds).
PREFLIGHT_MAX_AGE_S = 600


def install_cors(app: FastAPI, origins: list[str]) -> None:
    """Add the middleware when ``origins`` is not empty (call it last: it must be outermost,
    so that preflights skip the API key and error responses carry the headers too)."""
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=list(EXPOSED_HEADERS),
        allow_credentials=False,
        max_age=PREFLIGHT_MAX_AGE_S,
    )
