"""A fault-injecting engine wrapper for reliability tests (a named stand-in, never a working engine).

It wraps a real engine and passes every request through, except those whose text carries a marker:
`[raise]` yields the real engine's first piece and then raises; `[raise-first]` raises before any audio;
`[hang]` yields nothing and never finishes until cancelled. The marker is removed from the text the real
engine sees. `hung_cancelled` counts hung requests that were cancelled (observable engine stop).
"""

from __future__ import annotations

import asyncio
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
