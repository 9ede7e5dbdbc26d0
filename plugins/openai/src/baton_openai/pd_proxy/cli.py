"""``baton pd-proxy``: its flags and its run."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from baton_openai.pd_proxy.app import create_app
from baton_openai.pd_proxy.flow import Upstreams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help='producer engines\' base URLs (baton serve with [kv_transfer] connector = "pd", '
        'role = "producer"), taken in turn',
    )
    p.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help='consumer engines\' base URLs (role = "consumer"), taken in turn',
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds an engine may take to answer (default 600)",
    )


def main(args: argparse.Namespace) -> int:
    logging.getLogger("uvicorn").setLevel(logging.INFO)
    upstreams = Upstreams(args.prefill, args.decode, args.timeout)
    uvicorn.run(create_app(upstreams), host=args.host, port=args.port, log_level="info")
    return 0
