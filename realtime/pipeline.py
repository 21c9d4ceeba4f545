"""One unit through the shared path: scheduler slot, engine, renderer. Used by WebSocket and REST alike."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from voicewire.adapters.base import EngineInfo, SynthesisRequest
from voicewire.protocol.messages import EffectiveConfig
from voicewire.protocol.render import RenderedPiece, RenderPlan, UnitRenderer, plan_speed
from voicewire.realtime.context import ServerContext


class UnitTimeout(Exception):
    """A unit's engine work ran past `Settings.unit_timeout_s`; it was cancelled."""


def render_plan(config: EffectiveConfig, info: EngineInfo, *, stream: bool | None = None) -> RenderPlan:
    """How a unit under `config` is rendered: engine speed, extra time-stretch, rates, format."""
    engine_speed, stretch = plan_speed(config.speed, info.capabilities.speed_range)
    return RenderPlan(response_format=config.response_format,
                      stream=config.stream_audio if stream is None else stream,
                      native_rate=info.sample_rate, output_rate=config.sample_rate,
                      engine_speed=engine_speed, stretch=stretch)


def synthesis_request(request_id: str, text: str, config: EffectiveConfig, plan: RenderPlan) -> SynthesisRequest:
    # Codec-frame options are accepted only for engines that honour them (resolve_config).
    options: dict[str, object] = {}
    if config.initial_codec_chunk_frames is not None:
        options["initial_codec_chunk_frames"] = config.initial_codec_chunk_frames
    if config.max_new_tokens is not None:
        options["max_new_tokens"] = config.max_new_tokens
    return SynthesisRequest(request_id=request_id, text=text, voice=config.voice, speed=plan.engine_speed,
                            language=config.language, seed=config.seed, instructions=config.instructions,
                            options=options)


async def synthesize_unit(ctx: ServerContext, request: SynthesisRequest, renderer: UnitRenderer, deadline: float,
                          sink: Callable[[RenderedPiece], None]) -> float:
    """Run one unit: wait for an engine slot (earliest `deadline` first), pass each rendered piece to
    `sink` as the engine yields it, then the renderer's tail. Returns the engine seconds spent.

    Cancelling the caller cancels the wait or closes the engine iterator (the engine's cancel API); so
    does a unit running past `unit_timeout_s` of engine time, which raises `UnitTimeout`. Engine
    exceptions propagate after the iterator is closed and the slot released.
    """
    assert ctx.scheduler is not None
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
    sink(renderer.finish())
    return engine_s
