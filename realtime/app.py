"""The aiohttp application factory and the WebSocket, health and readiness routes.

`create_app(settings, engine)` returns a ready-to-run `web.Application`; the engine is started (loaded and
warmed) in a cleanup context, so `/ready` turns true only once the first request would be fast, and the
engine is closed when the app stops. A vllm-omni voice directory to import (`realtime.voice_import`) is
checked when the app is created and imported once the engine is started, before anything is served.

Signals (under `voicewire serve`, handled on the main thread): SIGTERM or SIGINT starts a drain: `/ready`
answers 503 and new sessions and requests are refused with 503 while the listener stays open; each open
session is closed with 1001 as soon as it is settled (no utterance open or unfinished, nothing to send), so
an utterance the client started, even one whose text is still arriving, is finished, and one it had not
started is never begun; after `shutdown_grace_s` (or once no session is left) the server stops, closing
what is left with 1001. A second SIGTERM or SIGINT stops it at once. SIGHUP re-reads the API key file
(closing the sessions of revoked keys once their audio in progress is sent); it never stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from voicewire.adapters.base import Engine
from voicewire.adapters.registry import create_engine
from voicewire.adapters.talker_codec import engine_codec
from voicewire.adapters.workers import PoolHealth, pool_health
from voicewire.protocol.session import CLOSE_POLICY
from voicewire.realtime import admission
from voicewire.realtime.auth import IDENTITY, AccessControl, Identity, access_middleware
from voicewire.realtime.bodies import ARRIVING, ArrivingRequests, body_deadline_middleware, head_arrived_middleware
from voicewire.realtime.context import Server, ServerContext
from voicewire.realtime.openai_errors import OpenAIError
from voicewire.realtime.request_id import add_request_id
from voicewire.realtime.rest import REST, add_rest_routes
from voicewire.realtime.session import SessionRuntime, resume_connection
from voicewire.realtime.settings import Settings
from voicewire.realtime.voice_import import check_source, import_vllm_omni_voices
from voicewire.realtime.voices import VoiceStore, default_voices_dir

log = logging.getLogger("voicewire")

SERVER: web.AppKey[Server] = web.AppKey("voicewire_server", Server)
CLOSE_GOING_AWAY = 1001
CLOSE_TRY_AGAIN_LATER = 1013
KEY_FILE_POLL_S = 2.0
UNSENT_GRACE_S = 5.0
DRAIN_POLL_S = 0.05


@dataclass(slots=True, eq=False)
class AppState:
    """What the WebSocket route and the signal handlers keep beside the server (`SERVER`)."""

    admission: admission.Admission
    session_keys: dict[SessionRuntime, str | None] = field(default_factory=dict)
    """The key id each open session authenticated with (None when auth is off)."""
    drain_deadline: float | None = None
    """Monotonic time by which a drain (SIGTERM) closes what is still open."""
    exiting: bool = False
    """The drain is over and the server is stopping; further stop signals are ignored."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    """Background work of the signal handlers (the drain, closing revoked sessions)."""

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` as a task held until it ends."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


STATE: web.AppKey[AppState] = web.AppKey("voicewire_app_state", AppState)


def create_app(settings: Settings | None = None, engine: Engine | None = None) -> web.Application:
    """Build the app. `engine` defaults to the one named by `settings.engine` (not started yet)."""
    settings = settings or Settings()
    engine = engine or create_engine(settings.engine, workers=settings.engine_workers,
                                     isolation=settings.engine_isolation, processes=settings.engine_processes)
    access = AccessControl(settings)
    voices_dir = settings.voices_dir or default_voices_dir()
    if settings.import_vllm_omni_voices is not None:
        check_source(settings.import_vllm_omni_voices, voices_dir)
    voices = VoiceStore(voices_dir, max_voices=settings.max_voices, max_upload_bytes=settings.max_voice_upload_bytes)
    server = Server(settings=settings, engine=engine, access=access, voices=voices)
    arriving = ArrivingRequests(settings.max_bodies_per_ip, heads=not settings.trust_forwarded_for)
    app = web.Application(client_max_size=settings.max_config_bytes,
                          middlewares=[head_arrived_middleware(arriving), access_middleware(access)])
    app[SERVER] = server
    app[ARRIVING] = arriving
    metrics = server.metrics
    metrics.engine_workers.read = lambda: pool_health(engine)
    metrics.codec.read = lambda: engine_codec(engine)
    app[STATE] = state = AppState(admission.Admission(metrics, settings.admission_utilization))
    metrics.engine_speed.set_function(lambda: state.admission.measure() or 0.0)
    metrics.capacity_streams.set_function(lambda: state.admission.capacity(_slots(server)) or 0.0)
    metrics.speaking_streams.set_function(lambda: _speaking(app))
    metrics.sessions_waiting.set_function(lambda: 0 if server.context is None else server.context.resumes.waiting)
    app.on_response_prepare.append(_no_referrer)
    app.on_response_prepare.append(add_request_id)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.cleanup_ctx.append(_signals_and_key_file)
    app.on_shutdown.append(_shutdown_sessions)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/audio/speech/stream", speech_stream)
    add_rest_routes(app, server)
    app.middlewares.append(body_deadline_middleware(access, arriving))  # innermost: it answers a body's timeout itself
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
    speech routes turn on when it is warm (the `ServerContext` is built then). A failed start is reported by
    `/health` (500) and logged."""
    server = app[SERVER]
    unwatch_gc = server.metrics.watch_gc()
    starting = asyncio.create_task(_start_engine(server))
    try:
        yield
    finally:
        unwatch_gc()
        server.shutting_down = True
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await server.engine.close()
        server.audio.close()


async def _start_engine(server: Server) -> None:
    started = time.monotonic()
    try:
        await server.engine.start()
        ctx = ServerContext.build(server.settings, server.engine, server.metrics, server.voices, server.audio)
        if server.settings.import_vllm_omni_voices is not None:  # before the first request, after restore
            await import_vllm_omni_voices(server.voices, server.settings.import_vllm_omni_voices,
                                          reserved=(*ctx.facts.engine.voices, *ctx.facts.voice_aliases))
        server.context = ctx
    except Exception as exc:
        server.engine_error = f"{type(exc).__name__}: {exc}"
        log.exception("engine %s failed to start", server.settings.engine)
        return
    log.info("engine %s ready in %.2f s", server.engine.info.name, time.monotonic() - started)
    _freeze_heap()


def _freeze_heap() -> None:
    """Move every object alive once the engine is ready (modules, the engine's framework, its weights'
    wrappers: millions of objects with an in-process GPU engine) out of the garbage collector's reach, so
    a full collection while sessions speak scans only what they allocate. Unfrozen, one full collection
    over that heap pauses the event loop, and every stream with it, for up to a few hundred ms.

    The collection after the freeze resets the collector's count of long-lived objects to the unfrozen
    few. CPython starts a full collection only once the objects promoted since the last one exceed a
    quarter of that count; left at the startup heap's size, the first full collection would wait for
    hundreds of thousands of session objects and then scan them all in one pause."""
    gc.collect()
    gc.freeze()
    gc.collect()
    log.debug("garbage collector: %d startup objects frozen", gc.get_freeze_count())


async def _shutdown_sessions(app: web.Application) -> None:
    """App shutdown: let sessions finish their audio until the drain's deadline (`shutdown_grace_s` from
    the start of the drain, or from now), then close them all with 1001."""
    server = app[SERVER]
    server.shutting_down = True
    state = app[STATE]
    if state.drain_deadline is None:
        state.drain_deadline = time.monotonic() + server.settings.shutdown_grace_s
    ctx = server.context
    if ctx is None:
        return
    await _until_idle(ctx, list(ctx.sessions), state.drain_deadline)
    await asyncio.gather(*(s.shutdown(CLOSE_GOING_AWAY, "server shutting down") for s in list(ctx.sessions)),
                         return_exceptions=True)


async def _until_idle(ctx: ServerContext, runtimes: list[SessionRuntime], deadline: float) -> None:
    """Wait until none of `runtimes` has audio or events left to send, or until `deadline` (monotonic)."""
    while any(s.busy for s in runtimes if s in ctx.sessions) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(DRAIN_POLL_S)


async def health(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP and its engine has not failed, at start or since (500 if it has:
    only a restart brings it back)."""
    failure = request.app[SERVER].engine_failure()
    if failure is not None:
        return web.json_response({"status": "error", "engine_error": failure}, status=500)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: the engine is loaded and warm, at least one of its worker processes is live (when it runs
    in workers), and the server is not shutting down. Reports the workers' states either way."""
    server = request.app[SERVER]
    workers = pool_health(server.engine)
    report = {} if workers is None else {"engine_workers": _workers_report(workers)}
    ctx = server.serving()
    if ctx is None:
        failure = server.engine_failure()
        reason = {} if failure is None else {"reason": failure}
        return web.json_response({"status": "not ready", **reason, **report}, status=503)
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
    after it, with close code 1013: the server already has `max_sessions` sessions, or the engine capacity
    is spoken for (`realtime.admission`). A connection opened with `?session_id=` resumes that session
    (`realtime.session.resume_connection`); it creates no session, so neither cap refuses it.
    """
    server = request.app[SERVER]
    ctx = server.serving()
    if ctx is None:
        return OpenAIError(503, "The engine is not ready; retry shortly", code="not_ready").response()
    who: Identity = request[IDENTITY]
    try:
        server.access.open_session(who)
    except OpenAIError as exc:
        ctx.metrics.sessions_refused.labels("limit").inc()
        return exc.response()
    try:
        # No permessage-deflate: audio barely compresses (about 5 %) and zlib costs ~6 ms per second of audio,
        # which lands on time to first audio (bench/ttfa.py --compression).
        ws = web.WebSocketResponse(max_msg_size=ctx.settings.max_config_bytes, heartbeat=20.0, compress=False)
        await ws.prepare(request)
        resume_id = request.query.get("session_id")
        if resume_id is not None:
            await resume_connection(ws, request.transport, ctx, who.key, resume_id)
            return ws
        if len(ctx.sessions) >= ctx.settings.max_sessions:
            ctx.metrics.sessions_refused.labels("full").inc()
            await ws.close(code=CLOSE_TRY_AGAIN_LATER, message=b"server full")
            return ws
        if not request.app[STATE].admission.admits(_speaking(request.app), _slots(server)):
            ctx.metrics.sessions_refused.labels("capacity").inc()
            await ws.close(code=CLOSE_TRY_AGAIN_LATER,
                           message=f"server at capacity; retry after {admission.RETRY_AFTER_S} s".encode())
            return ws
        state = request.app[STATE]

        def ended(runtime: SessionRuntime) -> None:
            ctx.sessions.discard(runtime)
            state.session_keys.pop(runtime, None)
            ctx.metrics.sessions_open.dec()

        runtime = SessionRuntime(ws, ctx, key=who.key, transport=request.transport, on_end=ended,
                                 draining=lambda: server.shutting_down)
        ctx.sessions.add(runtime)
        state.session_keys[runtime] = who.key
        ctx.metrics.sessions_total.inc()
        ctx.metrics.sessions_open.inc()
        await runtime.run()
        return ws
    finally:
        asyncio.get_running_loop().call_later(UNSENT_GRACE_S, _drop_unsent, request)
        server.access.close_session(who)


def _speaking(app: web.Application) -> int:
    """Admission's demand: sessions with audio to produce or send, and REST speech requests in progress."""
    ctx = app[SERVER].context
    sessions = 0 if ctx is None else sum(1 for s in ctx.sessions if s.busy)
    return sessions + app[REST].in_flight


def _slots(server: Server) -> int:
    return 0 if server.context is None else server.context.scheduler.capacity


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


async def _no_referrer(request: web.Request, response: web.StreamResponse) -> None:
    """`Referrer-Policy: no-referrer` on every response: the demo page is opened as `/?token=KEY`, and
    without it every asset the page loads would carry that URL, key included, in its `Referer`."""
    response.headers["Referrer-Policy"] = "no-referrer"


async def _signals_and_key_file(app: web.Application) -> AsyncIterator[None]:
    """Watch the API key file (re-read within `KEY_FILE_POLL_S` of a change) and, on the main thread
    only (`voicewire serve`; an embedding thread keeps its own signals), handle SIGHUP (reload keys),
    SIGTERM and SIGINT (drain, then stop) as the module docstring says."""
    server = app[SERVER]
    loop = asyncio.get_running_loop()
    watcher = asyncio.create_task(_watch_key_file(app)) if server.access.keys.file is not None else None
    signals = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT) if hasattr(signal, "SIGHUP") else ()
    if threading.current_thread() is not threading.main_thread():
        signals = ()
    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, app, sig)
    try:
        yield
    finally:
        if watcher is not None:
            watcher.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)


def _on_signal(app: web.Application, sig: signal.Signals) -> None:
    server = app[SERVER]
    state = app[STATE]
    if sig == signal.SIGHUP:
        if server.access.keys.file is None:
            log.info("SIGHUP: no API key file is configured; nothing to reload")
        else:
            _reload_keys(app, force=True)
        return
    if state.exiting:
        log.info("%s: already stopping", sig.name)
    elif server.shutting_down:
        log.warning("%s again: stopping now", sig.name)
        state.exiting = True
        raise web.GracefulExit()
    else:
        grace = server.settings.shutdown_grace_s
        log.info("%s: draining: /ready answers 503, new sessions and requests are refused, open sessions "
                 "have %g s to finish their audio", sig.name, grace)
        server.shutting_down = True
        state.drain_deadline = time.monotonic() + grace
        state.spawn(_drain_then_stop(app), "drain")


async def _drain_then_stop(app: web.Application) -> None:
    """Close each session with 1001 once it is settled (up to the drain deadline), then stop the server the
    way aiohttp's own signal handler does (GracefulExit out of the loop): listener closed, what is left
    closed with 1001, engine closed."""
    ctx = app[SERVER].context
    state = app[STATE]
    assert state.drain_deadline is not None
    if ctx is not None:
        await _close_when_settled(ctx, state, state.drain_deadline)
    if not state.exiting:
        state.exiting = True
        asyncio.get_running_loop().call_soon(_raise_graceful_exit)


async def _close_when_settled(ctx: ServerContext, state: AppState, deadline: float) -> None:
    """Close every session with 1001 at its first settled moment (`SessionRuntime.settled`), until none is
    left or until `deadline` (monotonic). A session may start another utterance before it settles; that
    one is finished too (within the deadline)."""
    closing: set[SessionRuntime] = set()
    while time.monotonic() < deadline:
        open_ = [s for s in ctx.sessions if s not in closing]
        if not open_:
            return
        settled = [s for s in open_ if s.settled]
        closing.update(settled)
        for runtime in settled:
            state.spawn(runtime.shutdown(CLOSE_GOING_AWAY, "server shutting down"), f"drain-{runtime.session_id}")
        await asyncio.sleep(DRAIN_POLL_S)


def _raise_graceful_exit() -> None:
    raise web.GracefulExit()


async def _watch_key_file(app: web.Application) -> None:
    while True:
        await asyncio.sleep(KEY_FILE_POLL_S)
        _reload_keys(app, force=False)


def _reload_keys(app: web.Application, *, force: bool) -> None:
    """Re-read the key file (see `KeyRing.reload`), count a failure, and close the sessions of revoked
    keys: each finishes the audio it has in progress (up to `shutdown_grace_s`), then is closed with 1008
    "api key revoked"."""
    server = app[SERVER]
    state = app[STATE]
    result = server.access.keys.reload(force=force)
    if result.failed:
        server.metrics.key_reload_failures.inc()
    server.metrics.keys_stale.set(1 if server.access.keys.stale else 0)
    ctx = server.context
    if ctx is None:
        return  # no engine yet, so no sessions
    doomed = [r for r, key in state.session_keys.items() if key is not None and key in result.revoked]
    if doomed:
        log.info("closing %d sessions of revoked keys once their audio in progress is sent", len(doomed))
    for runtime in doomed:
        state.spawn(_close_revoked(ctx, runtime), f"revoke-{runtime.session_id}")


async def _close_revoked(ctx: ServerContext, runtime: SessionRuntime) -> None:
    await _until_idle(ctx, [runtime], time.monotonic() + ctx.settings.shutdown_grace_s)
    if runtime in ctx.sessions:
        ctx.metrics.sessions_revoked.inc()
        await runtime.shutdown(CLOSE_POLICY, "api key revoked")
