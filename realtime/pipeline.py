"""One unit through the shared path: scheduler slot, engine, renderer. Used by WebSocket and REST alike.

`UnitRun.start` runs a unit in its own task and collects its rendered pieces in order; both the WebSocket
writer and a REST response keep a few of them in flight (`Settings.max_units_in_flight`) and send the
oldest one's pieces as they come, so unit N+1 synthesizes while unit N streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from voicewire.protocol.engine import SpeechParams, SynthesisRequest, UnitTimeout
from voicewire.protocol.messages import EffectiveConfig
from voicewire.protocol.render import RenderedPiece, UnitRenderer, render_plan, synthesis_request
from voicewire.realtime.context import ServerContext


async def synthesize_unit(ctx: ServerContext, request: SynthesisRequest, renderer: UnitRenderer, deadline: float,
                          sink: Callable[[RenderedPiece], None]) -> float:
    """Run one unit: wait for an engine slot (earliest `deadline` first), pass each rendered piece to
    `sink` as the engine yields it, then the renderer's tail. Returns the engine seconds spent.

    Cancelling the caller cancels the wait or closes the engine iterator (the engine's cancel API); so
    does a unit running past `unit_timeout_s` of engine time, which raises `UnitTimeout`. Engine
    exceptions propagate after the iterator is closed and the slot released.
    """
    limit = ctx.settings.unit_timeout_s
    async with ctx.scheduler.slot(deadline):
        started = time.monotonic()
        deadline_cm = asyncio.timeout(limit)
        try:
            async with deadline_cm, contextlib.aclosing(ctx.engine.synthesize(request)) as pieces:
                async for piece in pieces:
                    sink(renderer.feed(piece))
        except TimeoutError as exc:
            if not deadline_cm.expired():
                raise  # the engine's own timeout, not our deadline
            raise UnitTimeout(f"timed out after {limit:g} s of synthesis and was cancelled") from exc
        finally:
            engine_s = time.monotonic() - started
            ctx.metrics.engine_busy.inc(engine_s)
            ctx.metrics.engine_audio.inc(renderer.audio_ms / 1000.0)
    sink(renderer.finish())
    return engine_s


@dataclass(slots=True, eq=False)
class UnitRun:
    """One unit synthesizing in its own task (see `start`). Its rendered pieces collect in `outbox`, in
    order, for one consumer to take; `done` turns true once the unit finished (`error` None) or failed
    (`error` is what it raised: `UnitTimeout` past its deadline, or the engine's exception); `engine_s` the
    engine seconds it spent. Cancelling `task` is for whoever drops the run: a cancelled run's `done` and
    `error` mean nothing (it may never turn `done`, or turn it with no error). Memory: the pieces not yet
    taken (at most one unit's audio)."""

    task: asyncio.Task[None] = field(init=False)
    outbox: deque[RenderedPiece] = field(default_factory=deque)
    done: bool = False
    error: Exception | None = None
    engine_s: float = 0.0

    @classmethod
    def start(cls, ctx: ServerContext, request_id: str, text: str, config: EffectiveConfig, params: SpeechParams,
              deadline: float, wake: Callable[[], None], *, stream: bool | None = None) -> UnitRun:
        """Render `text` under `config` (`render_plan`, `stream` as there) through `synthesize_unit` as engine
        request `request_id` with the engine fields `params` (`synthesis_request`); `wake()` is called after
        every piece and once when the unit is done. Cancelling `task` cancels the unit (the engine iterator
        is closed)."""
        renderer = UnitRenderer(render_plan(config, ctx.engine.info, stream=stream))
        request = synthesis_request(request_id, text, config, params, renderer.plan)
        run = cls()

        def sink(piece: RenderedPiece) -> None:
            run.outbox.append(piece)
            wake()

        async def body() -> None:
            try:
                run.engine_s = await synthesize_unit(ctx, request, renderer, deadline, sink)
            except Exception as exc:
                run.error = exc
            finally:
                renderer.close()
                run.done = True
                wake()

        run.task = asyncio.create_task(body(), name=request.request_id)
        return run
