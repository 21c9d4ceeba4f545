"""One unit through the shared path: scheduler slot, engine, renderer. Used by WebSocket and REST alike.

`UnitRun.start` runs a unit in its own task and hands its rendered pieces on in order. `UnitRuns` runs the
units a `protocol.output.OutputMachine` makes due, for the WebSocket writer and a REST response alike: the
machine keeps a few in flight (`Settings.max_units_in_flight`) and sends the oldest one's pieces as they
come, so unit N+1 synthesizes while unit N streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from voicewire.protocol.engine import (
    NO_TOKENS,
    SpeechParams,
    SynthesisRequest,
    UnitTimeout,
    UnitTooLong,
    VoiceSample,
    failure_of,
)
from voicewire.protocol.media import MediaError, data_url_bytes
from voicewire.protocol.messages import EffectiveConfig, ProtocolError
from voicewire.protocol.output import OutputMachine, UnitOutput
from voicewire.protocol.render import RenderedPiece, UnitRenderer, render_plan, synthesis_request
from voicewire.protocol.session import Unit
from voicewire.realtime.context import ServerContext
from voicewire.realtime.voices import VoiceStoreError, decode_sample

log = logging.getLogger("voicewire.pipeline")


async def synthesize_unit(ctx: ServerContext, request: SynthesisRequest, renderer: UnitRenderer, deadline: float,
                          sink: Callable[[RenderedPiece], None]) -> float:
    """Run one unit: wait for an engine slot (earliest `deadline` first), pass each rendered piece to
    `sink` as the engine yields it, then the renderer's tail. Returns the engine seconds spent.

    Cancelling the caller cancels the wait or closes the engine iterator (the engine's cancel API); so
    does a unit running past `unit_timeout_s` of engine time, which raises `UnitTimeout`, or past
    `max_unit_audio_s` of rendered audio, which raises `UnitTooLong` (the piece that crossed it is not
    passed on). Engine exceptions propagate after the iterator is closed and the slot released.

    A costly render (`RenderPlan.costly`: time-stretch, resample, compressed encoder) runs on
    `ctx.audio`'s threads, off the event loop; cancelled, it ends its piece first (`AudioThreads.run`).
    """
    limit = ctx.settings.unit_timeout_s
    max_audio_s = ctx.settings.max_unit_audio_s
    max_samples = max_audio_s * renderer.plan.output_rate
    off_loop = renderer.plan.costly
    async with ctx.scheduler.slot(deadline):
        started = time.monotonic()
        deadline_cm = asyncio.timeout(limit)
        try:
            async with deadline_cm, contextlib.aclosing(ctx.engine.synthesize(request)) as pieces:
                async for piece in pieces:
                    rendered = await ctx.audio.run_if(off_loop, renderer.feed, piece)
                    if renderer.output_samples > max_samples:
                        raise UnitTooLong(f"produced more than {max_audio_s:g} s of audio and was stopped")
                    sink(rendered)
        except TimeoutError as exc:
            if not deadline_cm.expired():
                raise  # the engine's own timeout, not our deadline
            raise UnitTimeout(f"timed out after {limit:g} s of synthesis and was cancelled") from exc
        finally:
            engine_s = time.monotonic() - started
            ctx.metrics.engine_busy.inc(engine_s)
            ctx.metrics.engine_audio.inc(renderer.audio_ms / 1000.0)
    sink(await ctx.audio.run_if(off_loop, renderer.finish))
    return engine_s


def decode_reference(ctx: ServerContext, ref_audio: str) -> VoiceSample:
    """An inline `ref_audio` (a `data:` URL, or bare base64 as vllm-omni also takes it) decoded like an
    uploaded sample, within the same bounds; URLs and paths are never fetched. Blocking (it decodes audio),
    so run it in a worker thread, once per session config or REST request, before any unit. Raises
    `ProtocolError` (`invalid_config`, param `ref_audio`, `reason` the media code) for audio refused."""
    value = ref_audio
    if ":" not in value.partition(",")[0]:
        value = "data:;base64," + value
    limit = ctx.voices.max_upload_bytes
    try:
        samples, rate, _ = decode_sample(data_url_bytes(value, max_bytes=limit), max_bytes=limit)
    except MediaError as exc:
        raise _bad_reference(exc.code, f"ref_audio {exc.message}") from None
    except VoiceStoreError as exc:
        raise _bad_reference(exc.code, exc.message.replace("audio_sample", "ref_audio", 1)) from None
    return VoiceSample.of(samples, rate)


def _bad_reference(code: str, detail: str) -> ProtocolError:
    return ProtocolError("invalid_config", f"Invalid session config: ref_audio: {detail}", param="ref_audio",
                         reason=code)


def needs_reference(ctx: ServerContext, params: SpeechParams) -> bool:
    """Whether `params` carries a `ref_audio` the served engine takes (so it must be decoded before its
    units run). An engine that cannot take one refuses the field by name, and one sent with
    `speaker_embedding` is refused for the pair (`resolve_config`, `conflicting_voice_source`): neither is
    decoded."""
    return (bool(params.ref_audio) and not params.speaker_embedding
            and "ref_audio" in ctx.engine.info.capabilities.fields)


def with_voice_reference(ctx: ServerContext, request: SynthesisRequest) -> SynthesisRequest:
    """`request` with the `reference` (`SynthesisRequest`) of the uploaded voice its `voice` names, for a
    cloning engine: the stored audio, and its transcript unless the request gave one (none: x-vector only).
    Blocking (it reads the voice file), so run it in a worker thread. A request that already has its
    reference (a decoded `ref_audio`) or names no uploaded voice is returned as it is."""
    stored = None if request.reference is not None else ctx.voices.get(request.voice)
    if stored is None:
        return request
    samples, rate = ctx.voices.load_audio(request.voice)
    ref_text, x_vector_only = request.ref_text, request.x_vector_only_mode
    if ref_text is None and stored.ref_text:
        ref_text = stored.ref_text
    elif ref_text is None and x_vector_only is None:
        x_vector_only = True  # no transcript: clone the timbre only, as vllm-omni does
    return msgspec.structs.replace(request, reference=VoiceSample.of(samples, rate), ref_text=ref_text,
                                   x_vector_only_mode=x_vector_only)


@dataclass(slots=True, eq=False)
class UnitRun:
    """One unit synthesizing in its own task (see `start`). `error` is what it raised once it failed
    (`UnitTimeout` past its deadline, or the engine's exception), `engine_s` the engine seconds it spent.
    Cancelling `task` is for whoever drops the run: a cancelled run's `error` means nothing."""

    task: asyncio.Task[None] = field(init=False)
    error: Exception | None = None
    engine_s: float = 0.0

    @classmethod
    def start(cls, ctx: ServerContext, request_id: str, text: str, config: EffectiveConfig, params: SpeechParams,
              deadline: float, sink: Callable[[RenderedPiece], None], finished: Callable[[UnitRun], None], *,
              stream: bool | None = None, reference: VoiceSample | None = None) -> UnitRun:
        """Render `text` under `config` (`render_plan`, `stream` as there) through `synthesize_unit` as engine
        request `request_id` with the engine fields `params` and the decoded `ref_audio` `reference`
        (`synthesis_request`; a cloning engine's request without one gets its uploaded voice's, if `voice`
        names one, `with_voice_reference`): `sink` gets each rendered
        piece in order, then `finished(run)` is called once (also when the task is cancelled). Cancelling
        `task` cancels the unit (the engine iterator is closed)."""
        renderer = UnitRenderer(render_plan(config, ctx.engine.info, stream=stream))
        request = synthesis_request(request_id, text, config, params, renderer.plan, reference)
        run = cls()

        async def body() -> None:
            nonlocal request
            try:
                if ctx.engine.info.capabilities.voice_cloning and request.reference is None:
                    request = await asyncio.to_thread(with_voice_reference, ctx, request)
                run.engine_s = await synthesize_unit(ctx, request, renderer, deadline, sink)
            except Exception as exc:
                run.error = exc
            finally:
                renderer.close()
                finished(run)

        run.task = asyncio.create_task(body(), name=request.request_id)
        return run


class UnitRuns:
    """The engine side of one `OutputMachine`, for WebSocket sessions and REST requests alike: starts the
    units it makes due (a `UnitRun` each, named `request_id(unit)`, at the unit's deadline, its pieces and
    end fed back to the machine, `wake()` after each), cancels the ones it drops, and counts each unit once
    when it ends (`voicewire_units_total` by outcome, `voicewire_audio_seconds_total` by `route`).

    Call `settle()` after every call into the machine that can start or end units (`commit`,
    `cancel_utterance`, `close`, `next_output`), and `aclose()` once the machine is closed."""

    def __init__(self, ctx: ServerContext, output: OutputMachine, request_id: Callable[[Unit], str], route: str,
                 wake: Callable[[], None], *, stream: bool | None = None) -> None:
        self.ctx = ctx
        self.output = output
        self.started = 0
        """Engine requests started so far."""
        self.failed: UnitOutput | None = None
        """The first unit that ended `failed`."""
        self.error: Exception | None = None
        """What that unit raised."""
        self.hold = False
        """While true, units the machine makes due wait instead of starting (a WebSocket session waiting
        for a resume: it finishes its units in flight and takes no new engine work)."""
        self.tokens = NO_TOKENS
        """What the engine counted for the units so far (`AudioPiece.tokens`), usage."""
        self._request_id = request_id
        self._route = route
        self._wake = wake
        self._stream = stream
        self._runs: dict[UnitOutput, UnitRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def settle(self) -> list[UnitOutput]:
        """Retire the units that ended (returned, each once) and start those now due."""
        ended = self.output.take_ended()
        metrics = self.ctx.metrics
        for out in ended:
            run = self._runs.pop(out, None)
            if out.outcome == "cancelled" and run is not None:
                run.task.cancel()
            elif out.outcome == "failed" and self.failed is None and run is not None:
                self.failed, self.error = out, run.error
            metrics.units.labels(out.outcome).inc()
            if out.samples_sent:
                metrics.audio_seconds.labels(self._route).inc(out.samples_sent / out.unit.config.sample_rate)
        if not self.hold:
            for out in self.output.take_due():
                self._start(out)
        return ended

    async def aclose(self) -> None:
        """Wait for the unit tasks to finish (cancelled ones included)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _start(self, out: UnitOutput) -> None:
        unit = out.unit
        output, wake = self.output, self._wake

        def sink(piece: RenderedPiece) -> None:
            self.tokens += piece.tokens
            output.piece(out, piece)
            wake()

        def finished(run: UnitRun) -> None:
            output.unit_finished(out, run.engine_s, None if run.error is None else failure_of(run.error))
            wake()

        run = self._runs[out] = UnitRun.start(
            self.ctx, self._request_id(unit), unit.text, unit.config, unit.params, out.deadline_ms / 1000.0, sink,
            finished, stream=self._stream, reference=unit.reference)
        self.started += 1
        self._tasks.add(run.task)
        run.task.add_done_callback(self._tasks.discard)
        run.task.add_done_callback(lambda _: _log_failure(run))


def _log_failure(run: UnitRun) -> None:
    """Log a unit's failure when it happens (the output may never get to report it: the session can close
    first)."""
    if isinstance(run.error, UnitTimeout | UnitTooLong):
        log.warning("unit %s: %s", run.task.get_name(), run.error)
    elif run.error is not None:
        log.error("unit %s failed", run.task.get_name(), exc_info=run.error)
