"""`voicewire serve`: run the server (also `python -m voicewire.realtime`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from aiohttp import web
from voicewire.adapters.base import Engine
from voicewire.adapters.registry import ENGINE_NAMES, create_engine
from voicewire.realtime.app import create_app
from voicewire.realtime.auth import AccessLog
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
    serve.add_argument("--engine-isolation", choices=("process", "thread"), default=defaults.engine_isolation,
                       help="hibari in child processes (a crashed worker is restarted) or in threads")
    serve.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    serve.add_argument("--admission-utilization", type=float, default=defaults.admission_utilization,
                       metavar="SHARE", help="refuse new sessions (close 1013) while those speaking need more than "
                       "this share of the engine's measured capacity; 0: admit by --max-sessions only")
    serve.add_argument("--voices-dir", type=Path, help="where uploaded voices are stored "
                       "(default: $XDG_DATA_HOME/voicewire/voices)")
    auth = serve.add_argument_group("access")
    auth.add_argument("--api-key", action="append", default=[], metavar="KEY",
                      help="an accepted API key (repeatable); also read from $VOICEWIRE_API_KEYS, comma-separated")
    auth.add_argument("--api-keys-file", type=Path, help="one key per line; re-read on SIGHUP and on change")
    auth.add_argument("--no-auth", action="store_true",
                      help="serve without API keys: anyone who reaches the port can use it (development only)")
    auth.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                      help="a browser origin allowed to open WebSockets besides the server's own (repeatable)")
    auth.add_argument("--trust-forwarded-for", action="store_true",
                      help="take client addresses from X-Forwarded-For (only behind a proxy that sets it)")
    talker = serve.add_argument_group("talker engine (--engine talker; docs/engines.md)")
    talker.add_argument("--talker-model", metavar="DIR", help="local folder of the talker (Orpheus layout)")
    talker.add_argument("--codec-model", metavar="DIR", help="local folder of the SNAC 24 kHz codec")
    talker.add_argument("--talker-max-concurrency", type=int, default=64,
                        help="units the talker computes at once (vLLM max_num_seqs)")
    talker.add_argument("--talker-gpu-memory-utilization", type=float, default=0.8,
                        help="vLLM's share of GPU memory (of RAM on a CPU build)")
    talker.add_argument("--initial-codec-chunk-frames", type=int, default=1,
                        help="frames in a unit's first audio chunk (85.3 ms each); sessions may override")
    talker.add_argument("--talker-random-weights", action="store_true",
                        help="test and benchmark mode: random talker weights, forced lengths (no real speech)")
    serve.add_argument("--log-level", default="INFO")
    return parser


def talker_engine(args: argparse.Namespace) -> Engine | None:
    """The talker engine the flags describe, or None for other engines."""
    if args.engine != "talker":
        return None
    if not args.talker_model or not args.codec_model:
        raise ValueError("engine talker needs --talker-model DIR and --codec-model DIR")
    from voicewire.adapters.talker import TalkerConfig
    from voicewire.adapters.talker_codec import ChunkPolicy

    config = TalkerConfig(talker_model=args.talker_model, codec_model=args.codec_model,
                          max_concurrency=args.talker_max_concurrency,
                          gpu_memory_utilization=args.talker_gpu_memory_utilization,
                          chunks=ChunkPolicy(initial_frames=args.initial_codec_chunk_frames),
                          random_weights=args.talker_random_weights)
    return create_engine("talker", talker=config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env_keys = [k.strip() for k in os.environ.get("VOICEWIRE_API_KEYS", "").split(",") if k.strip()]
    settings = Settings(host=args.host, port=args.port, engine=args.engine, engine_workers=args.engine_workers,
                        engine_isolation=args.engine_isolation, max_sessions=args.max_sessions,
                        admission_utilization=args.admission_utilization,
                        api_keys=(*args.api_key, *env_keys), voices_dir=args.voices_dir,
                        api_keys_file=args.api_keys_file, allow_unauthenticated=args.no_auth,
                        allowed_origins=tuple(args.allowed_origin), trust_forwarded_for=args.trust_forwarded_for)
    try:
        app = create_app(settings, talker_engine(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"voicewire: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        logging.getLogger("voicewire").info("uvloop not installed; using the default event loop")
    web.run_app(app, host=settings.host, port=settings.port,
                shutdown_timeout=settings.shutdown_grace_s + 5.0, print=None,
                handler_cancellation=True, access_log_class=AccessLog, keepalive_timeout=settings.header_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
