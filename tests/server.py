"""A real voicewire server on loopback, in a thread with its own event loop, for tests and benches."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from voicewire.adapters.base import Engine
from voicewire.realtime.app import SERVER, create_app
from voicewire.realtime.auth import AccessLog
from voicewire.realtime.bodies import CountingSite
from voicewire.realtime.context import Server, ServerContext
from voicewire.realtime.settings import Settings

T = TypeVar("T")

API_KEY = "test-key-0123456789"
"""The key of the `keyed_server` fixture."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now (it may be taken before its user binds it)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that nothing holds now: all are held at once while they are
    chosen, so no two are the same (ports chosen one after another may repeat once the first is let go, and
    a process that binds the repeat first, e.g. HAProxy starting before the servers it balances, keeps the
    other user off its port)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


class Loopback:
    """A voicewire server listening on 127.0.0.1:`port` (set by the subclass): its HTTP and stream URLs."""

    port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"


class ServerThread(Loopback):
    """Starts `create_app(settings, engine)` on 127.0.0.1 in a daemon thread; `stop()` shuts it down.

    Settings without API keys run the server open (`allow_unauthenticated`); tests of auth pass keys. The
    constructor returns once the engine is warm, or raises (the server stopped) when the engine fails or is
    not warm within `start_timeout_s`.
    """

    def __init__(self, settings: Settings | None = None, engine: Engine | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        settings = settings or Settings()
        if not settings.api_keys and settings.api_keys_file is None:
            settings = dataclasses.replace(settings, allow_unauthenticated=True)
        self.settings = settings
        self.app = create_app(self.settings, engine)
        self.loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self.app, shutdown_timeout=5.0, handler_cancellation=True,
                                     access_log_class=AccessLog, keepalive_timeout=settings.header_timeout_s)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout_s):
            self.stop()
            raise TimeoutError(f"the engine was not warm within {start_timeout_s} s")
        if self._error is not None:
            raise self._error

    @property
    def state(self) -> Server:
        return self.app[SERVER]

    @property
    def ctx(self) -> ServerContext:
        """The running server's context (the server is started and warm once the constructor returns)."""
        ctx = self.state.context
        assert ctx is not None
        return ctx

    def engine_as(self, kind: type[T]) -> T:
        """The running server's engine, checked to be a `kind` (for tests of one engine's own state)."""
        engine = self.ctx.engine
        assert isinstance(engine, kind), f"the server runs {type(engine).__name__}, not {kind.__name__}"
        return engine

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as exc:  # reported to the constructor
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        """Listen, then wait until the engine is warm (the server answers /health meanwhile)."""
        await self._runner.setup()
        await CountingSite(self._runner, "127.0.0.1", self.port).start()
        while self.state.context is None:
            if self.state.engine_error is not None:
                raise RuntimeError(self.state.engine_error)
            await asyncio.sleep(0.02)

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's loop (for inspecting server state safely)."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    async def open_peer_ports(self) -> set[int]:
        """On the server's loop (`call`, `run_coroutine_threadsafe`): the client-side ports of the TCP
        connections the server holds open, for tests that check a closed session left no socket behind."""
        web_server = self._runner.server
        handlers = [] if web_server is None else web_server.connections
        return {h.transport.get_extra_info("peername")[1] for h in handlers if h.transport is not None}

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class ServerProcess(Loopback):
    """`python -m voicewire.realtime` as an operator runs it, its log (stdout and stderr) in `log`."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = free_port()
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "voicewire.realtime", "--port", str(self.port),
                                          *args], stdout=out, stderr=subprocess.STDOUT)

    def lines(self, text: str) -> int:
        """Log lines containing `text` so far."""
        return sum(text in line for line in self.log.read_text().splitlines())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
