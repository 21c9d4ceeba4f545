"""The engine interface every speech engine implements.

The data an engine takes and yields (`SynthesisRequest`, `AudioPiece`, `EngineInfo`, ...) lives on the
ground floor, `protocol/engine.py`, with the contract for cancelling and concurrency; this module adds
only the `Engine` protocol.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, runtime_checkable

from voicewire.protocol.engine import AudioPiece, EngineInfo, SynthesisRequest


@runtime_checkable
class Engine(Protocol):
    """A speech engine. `start()` loads and warms the model (no first-request penalty afterwards);
    `close()` frees it. `synthesize` may only be called between the two."""

    @property
    def info(self) -> EngineInfo: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]: ...
