"""Engine wrappers for reliability tests (named stand-ins, never working engines): faults and slowness.

`FaultInjectingEngine` wraps a real engine and passes every request through, except those whose text
carries a marker:
`[raise]` yields the real engine's first piece and then raises; `[raise-first]` raises before any audio;
`[raise-typed]` raises `InjectedEngineError`, an `EngineError` with a code of its own, before any audio;
`[hang]` yields nothing and never finishes until cancelled; `[burn]` spins a core on a thread that no cancel
stops (like a native text-processing stage) for `BURN_S`, for worker-process tests only. The marker is removed
from the text the real engine sees. `hung_cancelled` counts hung requests that were cancelled (observable
engine stop). With `refuse_start_while` set, `start()` fails while that file exists (a worker that cannot
come back). `fault_injecting_hibari` builds one around hibari inside an engine worker process
(`ProcessEngine(build=...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from pathlib import Path

from msgspec.structs import replace
from voicewire.adapters.base import Engine
from voicewire.adapters.hibari import HibariEngine
from voicewire.protocol.engine import AudioPiece, EngineError, EngineInfo, SynthesisRequest

BURN_S = 600.0


class InjectedFault(RuntimeError):
    pass


class InjectedEngineError(EngineError):
    """A typed engine failure, as an engine would define one: clients get its own `code`."""

    code = "injected_engine_error"


class FaultInjectingEngine:
    def __init__(self, inner: Engine, *, refuse_start_while: Path | None = None) -> None:
        self.inner = inner
        self.hung_cancelled = 0
        self.refuse_start_while = refuse_start_while

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    @property
    def stats(self) -> object:
        return getattr(self.inner, "stats")  # noqa: B009 (the inner engine's own counters)

    async def start(self) -> None:
        if self.refuse_start_while is not None and self.refuse_start_while.exists():
            raise InjectedFault(f"injected start failure: {self.refuse_start_while} exists")
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        text = request.text
        if "[hang]" in text:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.hung_cancelled += 1
                raise
        if "[burn]" in text:
            await asyncio.to_thread(_burn, BURN_S)
        if "[raise-typed]" in text:
            raise InjectedEngineError("injected typed engine error")
        if "[raise-first]" in text:
            raise InjectedFault("injected engine fault before any audio")
        clean = replace(request, text=text.replace("[raise]", ""))
        sent = False
        async for piece in self.inner.synthesize(clean):
            yield piece
            sent = True
            if "[raise]" in text:
                raise InjectedFault("injected engine fault mid-unit")
        if "[raise]" in text and not sent:
            raise InjectedFault("injected engine fault mid-unit")


def _burn(seconds: float) -> None:
    """Keep a core busy for `seconds`, checking nothing else (no cancel can reach it)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def fault_injecting_hibari(refuse_start_while: str | None = None, threads: int = 1) -> Engine:
    """A `FaultInjectingEngine` around a hibari of `threads` threads, for
    `ProcessEngine(build=functools.partial(...))`."""
    return FaultInjectingEngine(HibariEngine(workers=threads),
                                refuse_start_while=None if refuse_start_while is None else Path(refuse_start_while))


class EngineWrapper:
    """A real engine with its facts, start and close passed through; subclasses change `synthesize`."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()


class PacedEngine(EngineWrapper):
    """A slower engine for capacity tests (a named stand-in): passes a real engine's pieces through, but
    never more than `speed` seconds of audio per second of wall time (it sleeps before a piece that would
    come early), so one engine slot sustains `speed` real-time streams, whatever the machine."""

    def __init__(self, inner: Engine, speed: float) -> None:
        super().__init__(inner)
        self.speed = speed

    async def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        produced_s = 0.0
        async with contextlib.aclosing(self.inner.synthesize(request)) as pieces:
            async for piece in pieces:
                produced_s += len(piece.samples) / piece.sample_rate
                await asyncio.sleep(max(0.0, started + produced_s / self.speed - loop.time()))
                yield piece
