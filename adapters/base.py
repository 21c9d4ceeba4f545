"""The engine interface every speech engine implements.

The data an engine takes and yields (`SynthesisRequest`, `AudioPiece`, `EngineInfo`, ...) lives on the
ground floor, `protocol/engine.py`, with the contract for cancelling and concurrency; this module adds
the `Engine` protocol, the request accounting engines share (`counted_outcome`, `RequestCounts`), and
how an engine that can fail after start says so (`FailureReporting`, `engine_failure`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol, Self, runtime_checkable

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


@runtime_checkable
class FailureReporting(Protocol):
    """An engine that can lose, after `start()`, what it needs to serve: a process of its pipeline died
    (the `omni` engine's stage processes). `failure()` says why it cannot serve, or None while it can; it
    is cheap (no I/O, called per readiness probe and per new session or request) and, once not None, stays
    so until the server restarts."""

    def failure(self) -> str | None: ...


def engine_failure(engine: object) -> str | None:
    """Why a started engine can no longer serve, or None (always None for engines that cannot fail so)."""
    return engine.failure() if isinstance(engine, FailureReporting) else None


Outcome = Literal["completed", "cancelled", "failed"]
"""How one `synthesize` call ended."""


@contextmanager
def counted_outcome(count: Callable[[Outcome], None]) -> Iterator[None]:
    """`with counted_outcome(count):` around a `synthesize` body calls `count(outcome)` exactly once on leaving
    it: `completed` when the body ran to its end, `cancelled` when the consumer closed the iterator or was
    cancelled (`GeneratorExit`, `asyncio.CancelledError`), `failed` on any other exception, which goes on."""
    outcome: Outcome = "cancelled"
    try:
        yield
        outcome = "completed"
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException:
        outcome = "failed"
        raise
    finally:
        count(outcome)


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """Requests by outcome, the base of an engine's stats snapshot: `started` counts `synthesize` calls that
    began, and each ends as exactly one of `completed`, `cancelled` or `failed` (as `counted_outcome` decides),
    so `started` = the three + those in flight."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0

    def plus(self, **deltas: float) -> Self:
        """A copy with each named counter increased by its delta (names are the snapshot's fields)."""
        return dataclasses.replace(self, **{name: getattr(self, name) + delta for name, delta in deltas.items()})
