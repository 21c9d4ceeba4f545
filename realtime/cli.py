"""`voicewire serve`: run the server (also `python -m voicewire.realtime`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Literal

from aiohttp import web
from voicewire.adapters.base import Engine
from voicewire.adapters.registry import ENGINE_NAMES, create_engine
from voicewire.realtime.app import create_app
from voicewire.realtime.auth import AccessLog
from voicewire.realtime.bodies import CountingSite
from voicewire.realtime.settings import Settings
from voicewire.realtime.voice_import import ENV_VAR as IMPORT_ENV_VAR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voicewire", description="Realtime speech synthesis server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server")
    defaults = Settings()
    serve.add_argument("--host", default=defaults.host,
                       help="address to listen on (default %(default)s: this machine only; 0.0.0.0 for every "
                       "interface)")
    serve.add_argument("--port", type=int, default=defaults.port, help="TCP port (default %(default)s)")
    serve.add_argument("--engine", choices=ENGINE_NAMES, default=defaults.engine,
                       help="speech engine (default %(default)s; docs/engines.md)")
    serve.add_argument("--engine-workers", type=int, default=defaults.engine_workers,
                       help="engine requests computed at once (hibari: threads, about one core each)")
    serve.add_argument("--engine-isolation", choices=("process", "thread"), default=defaults.engine_isolation,
                       help="hibari in child processes (a crashed worker is restarted) or in threads")
    serve.add_argument("--engine-processes", type=int, default=defaults.engine_processes, metavar="P",
                       help="with process isolation: spread the --engine-workers threads over P child processes "
                       "(default: one each); fewer load fewer copies of the engine (memory), but a crash fails "
                       "every unit of its process")
    serve.add_argument("--max-sessions", type=int, default=defaults.max_sessions,
                       help="WebSocket sessions at once; one more is closed with code 1013 (default %(default)s)")
    serve.add_argument("--admission-utilization", type=float, default=defaults.admission_utilization,
                       metavar="SHARE", help="refuse new sessions (close 1013) while those speaking need more than "
                       "this share of the engine's measured capacity; 0: admit by --max-sessions only")
    serve.add_argument("--voices-dir", type=Path, help="where uploaded voices are stored "
                       "(default: $XDG_DATA_HOME/voicewire/voices)")
    serve.add_argument("--import-vllm-omni-voices", type=Path, metavar="DIR",
                       help="at start, import the voices a vllm-omni speech server stored in DIR (its "
                       "$SPEAKER_SAMPLES_DIR, by default ~/.cache/vllm-omni/speakers) into the voice store; "
                       "voices already there are kept (docs/operations.md); also $VOICEWIRE_IMPORT_VLLM_OMNI_VOICES")
    serve.add_argument("--server-id", metavar="NAME", help="this server's name behind a load balancer: session "
                       "ids start with it, so the balancer routes a resume to the right server (deploy/)")
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
    talker.add_argument("--codec-margin-ms", type=_seconds, default=None, metavar="MS", dest="codec_margin_s",
                        help="talker, and omni with voicewire's own codec: how long before a listener runs out of "
                             "audio its next chunk is cut, at least (default 120; the schedule adds the codec's "
                             "measured delay and queue to it; raise it where the codec's batches queue longer)")
    talker.add_argument("--talker-random-weights", action="store_true",
                        help="test and benchmark mode: random talker weights, forced lengths (no real speech)")
    omni = serve.add_argument_group("omni engine (--engine omni: vllm-omni's pipeline; docs/engines.md)")
    omni.add_argument("--model", metavar="DIR", help="local model folder (a Qwen3-TTS or Fish Speech S2 Pro model)")
    omni.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                      help="more ids clients may name the model by (vllm's flag), listed in /v1/models and "
                           "accepted as model besides --model as given and its HF-style name")
    omni.add_argument("--stage-config", metavar="YAML",
                      help="vllm-omni deploy/stage config (default: vllm-omni's own for the model type; on a CPU "
                           "build use adapters/omni_configs/qwen3_tts_cpu.yaml or fish_qwen3_omni_cpu.yaml)")
    omni.add_argument("--omni-max-concurrency", type=int, default=4,
                      help="units computed at once (at most the talker stage's max_num_seqs)")
    omni.add_argument("--omni-chunk-ramp", type=_chunk_ramp, default=None, metavar="paced|N,N,...|none",
                      help="how vllm-omni's code2wav stage cuts a unit's audio into chunks (Qwen3-TTS; implies "
                           "--omni-codec pipeline): paced (default: by each stream's "
                           "pace and the load, docs/engines.md), a fixed ramp of frames (80 ms) in each of a "
                           "unit's first chunks then the stage config's codec_chunk_frames, or none (the stage "
                           "config's chunking: one frame, then codec_chunk_frames)")
    omni.add_argument("--omni-pace-lead-ms", type=_pace_lead, default=None, metavar="MS,MS_PER_STREAM",
                      help="paced chunks (implies --omni-codec pipeline): the time from cutting a chunk to its audio "
                           "at the player, in ms plus ms "
                           "per stream the talker runs (default 55,1.5)")
    omni.add_argument("--omni-codec", choices=("pipeline", "voicewire"), default=None,
                      help="Qwen3-TTS: decode the talker's frames in voicewire's own batched codec path, chunks "
                           "cut by its paced schedule (voicewire, the default), or in vllm-omni's code2wav stage "
                           "(pipeline, the default where --omni-chunk-ramp or --omni-pace-lead-ms is given: they "
                           "cut that stage's chunks; docs/engines.md)")
    omni.add_argument("--omni-random-weights", action="store_true",
                      help="test and benchmark mode: random weights (load_format dummy), forced lengths")
    serve.add_argument("--log-level", default="INFO", type=str.upper,
                       choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                       help="log detail (default %(default)s; DEBUG adds the /health and /ready probes)")
    return parser


def _chunk_ramp(text: str) -> tuple[int, ...] | Literal["paced"]:
    """`--omni-chunk-ramp`: `paced` (kept as the word, so that giving it is told from leaving the flag out),
    comma-separated frame counts, or `none` (())."""
    word = text.strip().lower()
    if word in ("none", "paced"):
        return () if word == "none" else "paced"
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not paced, none or a list of frame counts: {text!r} "
                                         "(e.g. 1,2,4,8,16)") from None


def _seconds(text: str) -> float:
    """A flag given in milliseconds, as seconds."""
    try:
        return float(text) / 1000
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None


def _pace_lead(text: str) -> tuple[float, float]:
    """`--omni-pace-lead-ms`: milliseconds and milliseconds per stream, as seconds."""
    try:
        base, per_stream = (float(part) / 1000 for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not MS,MS_PER_STREAM: {text!r} (e.g. 55,1.5)") from None
    return base, per_stream


def talker_engine(args: argparse.Namespace) -> Engine | None:
    """The talker engine the flags describe, or None for other engines."""
    if args.engine != "talker":
        return None
    if not args.talker_model or not args.codec_model:
        raise ValueError("engine talker needs --talker-model DIR and --codec-model DIR")
    from voicewire.adapters.talker import TalkerConfig
    from voicewire.adapters.talker_codec import ChunkPolicy

    chunks = ChunkPolicy(initial_frames=args.initial_codec_chunk_frames)
    if args.codec_margin_s is not None:
        chunks = dataclasses.replace(chunks, margin_s=args.codec_margin_s)
    config = TalkerConfig(talker_model=args.talker_model, codec_model=args.codec_model,
                          max_concurrency=args.talker_max_concurrency,
                          gpu_memory_utilization=args.talker_gpu_memory_utilization,
                          chunks=chunks,
                          random_weights=args.talker_random_weights)
    return create_engine("talker", talker=config)


def omni_engine(args: argparse.Namespace) -> Engine | None:
    """The omni engine the flags describe, or None for other engines."""
    if args.engine != "omni":
        return None
    if not args.model:
        raise ValueError("engine omni needs --model DIR")
    from voicewire.adapters.omni import DEFAULT_PACING, OmniConfig

    given = args.omni_chunk_ramp  # None: the flag was left out
    ramp = None if given in (None, "paced") else given  # None: paced chunks
    pipeline_flags = given is not None or args.omni_pace_lead_ms is not None
    own_codec = args.omni_codec == "voicewire" or (args.omni_codec is None and not pipeline_flags)
    if own_codec and pipeline_flags:
        raise ValueError("--omni-codec voicewire cuts chunks by its own schedule: drop --omni-chunk-ramp and "
                         "--omni-pace-lead-ms")
    if ramp is not None and args.omni_pace_lead_ms is not None:
        raise ValueError("--omni-pace-lead-ms applies to paced chunks, not to --omni-chunk-ramp "
                         f"{'none' if not ramp else ','.join(map(str, ramp))}")
    if args.codec_margin_s is not None and not own_codec:
        raise ValueError("--codec-margin-ms applies to voicewire's own codec (--omni-codec voicewire); "
                         "vllm-omni's code2wav chunks are paced by --omni-pace-lead-ms")
    pacing = (args.omni_pace_lead_ms or DEFAULT_PACING) if ramp is None and not own_codec else None
    config = OmniConfig(model=args.model, stage_config=args.stage_config, max_concurrency=args.omni_max_concurrency,
                        random_weights=args.omni_random_weights, pacing=pacing, codec_chunk_ramp=ramp or (),
                        served_model_names=tuple(args.served_model_name), own_codec=own_codec,
                        codec_margin_s=args.codec_margin_s)
    return create_engine("omni", omni=config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env_keys = [k.strip() for k in os.environ.get("VOICEWIRE_API_KEYS", "").split(",") if k.strip()]
    env_import = os.environ.get(IMPORT_ENV_VAR, "").strip()
    import_voices = args.import_vllm_omni_voices or (Path(env_import) if env_import else None)
    try:
        settings = Settings(host=args.host, port=args.port, engine=args.engine, engine_workers=args.engine_workers,
                            engine_isolation=args.engine_isolation, engine_processes=args.engine_processes,
                            max_sessions=args.max_sessions,
                            admission_utilization=args.admission_utilization,
                            api_keys=(*args.api_key, *env_keys), voices_dir=args.voices_dir,
                            api_keys_file=args.api_keys_file, allow_unauthenticated=args.no_auth,
                            allowed_origins=tuple(args.allowed_origin), trust_forwarded_for=args.trust_forwarded_for,
                            server_id=args.server_id, import_vllm_omni_voices=import_voices)
        app = create_app(settings, talker_engine(args) or omni_engine(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"voicewire: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        logging.getLogger("voicewire").info("uvloop not installed; using the default event loop")
    run(app, settings)
    return 0


def run(app: web.Application, settings: Settings) -> None:
    """Serve `app` until a stop signal, as `web.run_app` does, but on a `CountingSite` (run_app takes no
    site), so connections count their request heads against their address (`realtime.bodies`). As in
    run_app, a stop first cleans the app up (the drain, the engine) with every other task still running,
    then cancels what is left."""
    loop = asyncio.new_event_loop()
    main = loop.create_task(_serve(app, settings))
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(main)
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _serve(app: web.Application, settings: Settings) -> None:
    runner = web.AppRunner(app, handle_signals=True, shutdown_timeout=settings.shutdown_grace_s + 5.0,
                           handler_cancellation=True, access_log_class=AccessLog,
                           keepalive_timeout=settings.header_timeout_s)
    await runner.setup()
    try:
        await CountingSite(runner, settings.host, settings.port).start()
        _log_listening(app, settings)
        await asyncio.Event().wait()  # until a stop signal raises GracefulExit out of the loop
    finally:
        await runner.cleanup()


def _log_listening(app: web.Application, settings: Settings) -> None:
    """Say where the server listens, once it does (after its sockets are bound)."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    demo = any(route.method == "GET" and route.resource is not None and route.resource.canonical == "/"
               for route in app.router.routes())
    logging.getLogger("voicewire").info("listening on http://%s:%d%s", host, settings.port,
                                        " (demo: /)" if demo else "")


if __name__ == "__main__":
    sys.exit(main())
