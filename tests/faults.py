"""Engine wrappers for reliability tests (named stand-ins, never working engines): faults and slowness.

`FaultInjectingEngine` wraps a real engine and passes every request through, except those whose text carries a marker:
`[raise]` yields the real engine's first piece and then raises; `[raise-first]` raises before any audio;
`[hang]` yields nothing and never finishes until cancelled. The marker is removed from the text the real
engine sees. `hung_cancelled` counts hung requests that were cancelled (observable engine stop).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace

from voicewire.adapters.base import AudioPiece, Engine, EngineInfo, SynthesisRequest


class InjectedFault(RuntimeError):
    pass


class FaultInjectingEngine:
    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.hung_cancelled = 0

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    @property
    def stats(self) -> object:
        return getattr(self.inner, "stats")  # noqa: B009 (the inner engine's own counters)

    async def start(self) -> None:
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


class PacedEngine:
    """A slower engine for capacity tests (a named stand-in): passes a real engine's pieces through, but
    never more than `speed` seconds of audio per second of wall time (it sleeps before a piece that would
    come early), so one engine slot sustains `speed` real-time streams, whatever the machine."""

    def __init__(self, inner: Engine, speed: float) -> None:
        self.inner = inner
        self.speed = speed

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        produced_s = 0.0
        async with contextlib.aclosing(self.inner.synthesize(request)) as pieces:
            async for piece in pieces:
                produced_s += len(piece.samples) / piece.sample_rate
                await asyncio.sleep(max(0.0, started + produced_s / self.speed - loop.time()))
                yield piece
