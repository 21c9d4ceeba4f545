"""A real voicewire server on loopback, in a thread with its own event loop, for tests and benches."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiohttp import web
from voicewire.adapters.base import Engine
from voicewire.realtime.app import SERVER, create_app
from voicewire.realtime.auth import AccessLog
from voicewire.realtime.context import Server, ServerContext
from voicewire.realtime.settings import Settings

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """Starts `create_app(settings, engine)` on 127.0.0.1 in a daemon thread; `stop()` shuts it down.

    Settings without API keys run the server open (`allow_unauthenticated`); tests of auth pass keys.
    """

    def __init__(self, settings: Settings | None = None, engine: Engine | None = None) -> None:
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
        self._started.wait(120)
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

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"

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
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        while self.state.context is None:
            if self.state.engine_error is not None:
                raise RuntimeError(self.state.engine_error)
            await asyncio.sleep(0.02)

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's loop (for inspecting server state safely)."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
