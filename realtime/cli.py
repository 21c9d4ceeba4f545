"""`voicewire serve`: run the server (also `python -m voicewire.realtime`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from aiohttp import web
from voicewire.adapters.registry import ENGINE_NAMES
from voicewire.realtime.app import create_app
from voicewire.realtime.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voicewire", description="Realtime speech synthesis server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server")
    defaults = Settings()
    serve.add_argument("--host", default=defaults.host)
    serve.add_argument("--port", type=int, default=defaults.port)
    serve.add_argument("--engine", choices=ENGINE_NAMES, default=defaults.engine)
    serve.add_argument("--engine-workers", type=int, default=defaults.engine_workers,
                       help="engine requests computed at once (hibari: threads, about one core each)")
    serve.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    serve.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(host=args.host, port=args.port, engine=args.engine, engine_workers=args.engine_workers,
                        max_sessions=args.max_sessions)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        logging.getLogger("voicewire").info("uvloop not installed; using the default event loop")
    web.run_app(create_app(settings), host=settings.host, port=settings.port,
                shutdown_timeout=settings.shutdown_grace_s + 5.0, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
