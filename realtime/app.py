"""The aiohttp application factory and the WebSocket, health and readiness routes.

`create_app(settings, engine)` returns a ready-to-run `web.Application`; the engine is started (loaded and
warmed) in a cleanup context, so `/ready` turns true only once the first request would be fast, and the
engine is closed when the app stops. Shutdown (SIGTERM under `voicewire serve`) stops accepting, lets
sessions finish their audio for up to `shutdown_grace_s`, then closes them with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from voicewire.adapters.base import Engine
from voicewire.adapters.registry import create_engine
from voicewire.adapters.workers import PoolHealth, pool_health
from voicewire.realtime.auth import IDENTITY, AccessControl, Identity, access_middleware
from voicewire.realtime.context import ServerContext
from voicewire.realtime.openai_errors import OpenAIError
from voicewire.realtime.rest import add_rest_routes
from voicewire.realtime.session import SessionRuntime
from voicewire.realtime.settings import Settings

log = logging.getLogger("voicewire")

CONTEXT: web.AppKey[ServerContext] = web.AppKey("voicewire_context", ServerContext)
CLOSE_GOING_AWAY = 1001
CLOSE_TRY_AGAIN_LATER = 1013
KEY_FILE_POLL_S = 2.0
UNSENT_GRACE_S = 5.0


def create_app(settings: Settings | None = None, engine: Engine | None = None) -> web.Application:
    """Build the app. `engine` defaults to the one named by `settings.engine` (not started yet)."""
    settings = settings or Settings()
    engine = engine or create_engine(settings.engine, workers=settings.engine_workers,
                                     isolation=settings.engine_isolation)
    access = AccessControl(settings)
    ctx = ServerContext(settings=settings, engine=engine, access=access)
    app = web.Application(client_max_size=settings.max_config_bytes, middlewares=[access_middleware(access)])
    app[CONTEXT] = ctx
    ctx.metrics.engine_workers.read = lambda: pool_health(engine)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.cleanup_ctx.append(_key_rotation)
    app.on_shutdown.append(_shutdown_sessions)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/audio/speech/stream", speech_stream)
    add_rest_routes(app, ctx)
    add_client_routes(app)
    return app


CLIENTS_JS_DIR = Path(__file__).resolve().parent.parent / "clients" / "js"
"""The browser client and demo page, in the source tree (an editable install serves them from there)."""


def add_client_routes(app: web.Application, folder: Path = CLIENTS_JS_DIR) -> None:
    """Serve the demo page at `/` and the browser client's files under `/clients/`.

    Does nothing when `folder` is missing (an installed wheel carries no `clients/js`): the demo is a
    source-tree convenience, never needed by the API.
    """
    index = folder / "index.html"
    if not index.is_file():
        log.info("no browser client at %s; the demo page is not served", folder)
        return

    async def demo_page(request: web.Request) -> web.FileResponse:
        return web.FileResponse(index, headers={"Cache-Control": "no-cache"})

    app.router.add_get("/", demo_page)
    app.router.add_static("/clients/", folder)


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Load and warm the engine in the background, so `/health` answers while it loads; `/ready` and the
    speech routes turn on when it is warm. A failed start is reported by `/health` (500) and logged."""
    ctx = app[CONTEXT]
    starting = asyncio.create_task(_start_engine(ctx))
    try:
        yield
    finally:
        ctx.ready = False
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await ctx.engine.close()


async def _start_engine(ctx: ServerContext) -> None:
    started = time.monotonic()
    try:
        await ctx.engine.start()
        ctx.on_engine_started()
    except Exception as exc:
        ctx.engine_error = f"{type(exc).__name__}: {exc}"
        log.exception("engine %s failed to start", ctx.settings.engine)
        return
    log.info("engine %s ready in %.2f s", ctx.engine.info.name, time.monotonic() - started)


async def _shutdown_sessions(app: web.Application) -> None:
    ctx = app[CONTEXT]
    ctx.shutting_down = True
    deadline = time.monotonic() + ctx.settings.shutdown_grace_s
    while any(s.busy for s in _runtimes(ctx)) and time.monotonic() < deadline:  # noqa: ASYNC110 (bounded poll)
        await asyncio.sleep(0.05)
    await asyncio.gather(*(s.shutdown(CLOSE_GOING_AWAY, "server shutting down") for s in _runtimes(ctx)),
                         return_exceptions=True)


def _runtimes(ctx: ServerContext) -> list[SessionRuntime]:
    return [s for s in ctx.sessions if isinstance(s, SessionRuntime)]


async def health(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP and its engine has not failed to start (500 if it has)."""
    ctx = request.app[CONTEXT]
    if ctx.engine_error is not None:
        return web.json_response({"status": "error", "engine_error": ctx.engine_error}, status=500)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: the engine is loaded and warm, at least one of its worker processes is live (when it runs
    in workers), and the server is not shutting down. Reports the workers' states either way."""
    ctx = request.app[CONTEXT]
    workers = pool_health(ctx.engine)
    report = {} if workers is None else {"engine_workers": _workers_report(workers)}
    if not ctx.ready or ctx.shutting_down:
        return web.json_response({"status": "not ready", **report}, status=503)
    if workers is not None and workers.live == 0:
        return web.json_response({"status": "not ready", "reason": "no engine worker is live; they are being "
                                  "restarted", **report}, status=503)
    return web.json_response({"status": "ready", "engine": ctx.engine.info.name, **report,
                              "sessions": len(ctx.sessions), "max_sessions": ctx.settings.max_sessions})


def _workers_report(health: PoolHealth) -> dict[str, object]:
    """Worker counts by state, requests waiting for a worker, restarts, and each slot's state and deaths in a
    row (no process ids: `/ready` is public)."""
    return {**health.counts(), "waiting": health.waiting, "restarts": health.restarts,
            "slots": [{"state": s.state, "failures": s.failures} for s in health.slots]}


async def speech_stream(request: web.Request) -> web.StreamResponse:
    """`GET /v1/audio/speech/stream`: one realtime synthesis session per WebSocket.

    Refused before the upgrade: not ready (503), over the key's or address's session cap (429). Refused
    after it, with close code 1013: the server already has `max_sessions` sessions.
    """
    ctx = request.app[CONTEXT]
    if not ctx.ready or ctx.shutting_down:
        return OpenAIError(503, "The engine is not ready; retry shortly", code="not_ready").response()
    who: Identity = request[IDENTITY]
    try:
        ctx.access.open_session(who)
    except OpenAIError as exc:
        ctx.metrics.sessions_refused.inc()
        return exc.response()
    try:
        # No permessage-deflate: audio barely compresses (about 5 %) and zlib costs ~6 ms per second of audio,
        # which lands on time to first audio (bench/ttfa.py --compression).
        ws = web.WebSocketResponse(max_msg_size=ctx.settings.max_config_bytes, heartbeat=20.0, compress=False)
        await ws.prepare(request)
        if len(ctx.sessions) >= ctx.settings.max_sessions:
            ctx.metrics.sessions_refused.inc()
            await ws.close(code=CLOSE_TRY_AGAIN_LATER, message=b"server full")
            return ws
        runtime = SessionRuntime(ws, ctx)
        ctx.sessions.add(runtime)
        ctx.metrics.sessions_total.inc()
        ctx.metrics.sessions_open.inc()
        try:
            await runtime.run()
        finally:
            ctx.sessions.discard(runtime)
            ctx.metrics.sessions_open.dec()
            asyncio.get_running_loop().call_later(UNSENT_GRACE_S, _drop_unsent, request)
        return ws
    finally:
        ctx.access.close_session(who)


def _drop_unsent(request: web.Request) -> None:
    """Abort a finished session's connection that still holds unsent bytes `UNSENT_GRACE_S` after the
    session ended: its client stopped reading (stall close, or a close handshake that timed out). A plain
    close waits to flush them, which for a peer that never reads keeps the socket and its buffers
    (megabytes of audio) forever, outside every cap. A client that reads again within the grace still gets
    everything, close frame included."""
    transport = request.transport
    if transport is not None and transport.get_write_buffer_size() > 0:
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):  # linger 0: reset, so the kernel drops them too
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()


async def _key_rotation(app: web.Application) -> AsyncIterator[None]:
    """Re-read the API key file on SIGHUP (main thread only) and whenever its modification time changes."""
    keys = app[CONTEXT].access.keys
    if keys.file is None:
        yield
        return
    loop = asyncio.get_running_loop()
    on_sighup = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP")
    if on_sighup:
        loop.add_signal_handler(signal.SIGHUP, lambda: keys.reload(force=True))

    async def watch() -> None:
        while True:
            await asyncio.sleep(KEY_FILE_POLL_S)
            keys.reload()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        if on_sighup:
            loop.remove_signal_handler(signal.SIGHUP)
