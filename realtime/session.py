"""The runtime of one WebSocket session: moves bytes and awaits engines; decisions live in `protocol`.

Three kinds of task per session:
- the reader (`run`) decodes frames, feeds `SessionMachine` and carries out its actions at once; it
  never awaits synthesis or a send, so `input.cancel` and `session.close` act while audio streams;
- one synthesis task per unit in flight, admitted by the shared `Scheduler`; it renders engine pieces
  into the unit's outbox;
- the writer, the only task that sends: control events first, then units strictly in order, each as
  `audio.start`, audio (and words), `audio.done`, and `session.done` after an utterance's last unit.

Bounds: at most `max_units_in_flight` units are synthesizing or waiting to be sent, so a client that
stops reading pauses its own synthesis and holds at most that many units of audio; control events
queued for such a client are capped (`max_pending_events`), and a send blocked past `stall_timeout_s`
closes the session with 1008. Cancel and disconnect cancel the unit tasks, which closes the engine
iterators (the engine's only cancel API).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from aiohttp import WSMsgType, web
from voicewire.protocol.messages import (
    AudioCancelled,
    AudioChunk,
    AudioDone,
    AudioStart,
    AudioWords,
    ErrorEvent,
    ProtocolError,
    ServerEvent,
    SessionConfig,
    SessionDone,
    Timings,
    WordTiming,
    decode_client_message,
    encode_event,
)
from voicewire.protocol.render import RenderedPiece, UnitRenderer, place_words
from voicewire.protocol.session import (
    CLOSE_POLICY,
    Action,
    CancelUtterance,
    Close,
    FinishUtterance,
    Send,
    SessionMachine,
    Synthesize,
    Unit,
)
from voicewire.realtime.context import ServerContext
from voicewire.realtime.pipeline import UnitTimeout, render_plan, synthesis_request, synthesize_unit

log = logging.getLogger("voicewire.session")

CLOSE_INTERNAL_ERROR = 1011
SECONDS_PER_CHAR_ESTIMATE = 0.065
"""Rough speech duration of one character, used to estimate playback deadlines of unsent units."""


@dataclass(slots=True, eq=False)
class UnitJob:
    """One unit from commit to `audio.done`: its synthesis task and its outbox of rendered audio."""

    unit: Unit
    renderer: UnitRenderer
    deadline_offset_s: float
    """Estimated audio duration of the units before this one in the utterance."""
    task: asyncio.Task[None] | None = None
    outbox: deque[RenderedPiece] = field(default_factory=deque)
    finished: bool = False
    failure: tuple[str, str] | None = None
    """(error code, reason) when the unit failed."""
    engine_s: float = 0.0
    started_sent: bool = False
    bytes_sent: int = 0
    samples_sent: int = 0
    chunk_id: int = 0
    words: list[WordTiming] = field(default_factory=list)
    offset_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class FinishMarker:
    utterance_index: int
    total_sentences: int


@dataclass(slots=True)
class UtteranceStats:
    committed_first_ms: float | None = None
    first_audio_ms: float | None = None
    audio_ms: float = 0.0
    engine_s: float = 0.0
    estimated_s: float = 0.0
    playback_start: float | None = None


class SessionRuntime:
    """Serves one accepted WebSocket until it closes. Create, then `await run()`."""

    def __init__(self, ws: web.WebSocketResponse, ctx: ServerContext) -> None:
        assert ctx.facts is not None and ctx.scheduler is not None
        self.ws = ws
        self.ctx = ctx
        self.settings = ctx.settings
        self.scheduler = ctx.scheduler
        self.session_id = ctx.next_id("sess")
        self.machine = SessionMachine(ctx.facts, self.session_id)
        self._outq: deque[UnitJob | FinishMarker] = deque()
        self._control: deque[ServerEvent] = deque()
        self._utterances: dict[int, UtteranceStats] = {}
        self._wake = asyncio.Event()
        self._close: Close | None = None
        self._last_activity = time.monotonic()
        self._unit_tasks: set[asyncio.Task[None]] = set()
        self._reader_task: asyncio.Task[None] | None = None
        self.engine_requests_started = 0

    # -- reader ---------------------------------------------------------------------------------

    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop(), name=f"{self.session_id}-writer")
        writer.add_done_callback(self._on_writer_done)
        reader = self._reader_task = asyncio.create_task(self._read_loop(), name=f"{self.session_id}-reader")
        try:
            await reader
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                reader.cancel()
                raise
        finally:
            self._cancel_everything()
            if self._close is not None and not writer.done():
                self._wake.set()
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(writer), self.settings.stall_timeout_s)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            await self._await_unit_tasks()
            if not self.ws.closed:
                code, reason = (self._close.code, self._close.reason) if self._close else (1000, "")
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ws.close(code=code, message=reason.encode()[:120]), 2.0)

    async def _read_loop(self) -> None:
        while self._close is None:
            timeout = self._receive_timeout()
            try:
                msg = await self.ws.receive(timeout=timeout)
            except TimeoutError:
                self._on_timer()
                continue
            if msg.type is WSMsgType.TEXT:
                self._last_activity = time.monotonic()
                try:
                    self._on_text(msg.data)
                except Exception:
                    log.exception("session %s: internal error handling a message", self.session_id)
                    self._internal_error()
            elif msg.type is WSMsgType.BINARY:
                self._last_activity = time.monotonic()
                self._apply(self.machine.protocol_error(ProtocolError(
                    "binary_not_supported", "Binary frames are not accepted; send JSON text frames")))
            else:
                return

    def _on_text(self, data: str) -> None:
        try:
            message = decode_client_message(data)
            limit = (self.settings.max_config_bytes if isinstance(message, SessionConfig)
                     else self.settings.max_message_bytes)
            if len(data) > limit:
                kind = "session.config" if isinstance(message, SessionConfig) else "input.text"
                raise ProtocolError("message_too_large", f"{kind} message too large")
        except ProtocolError as exc:
            self._apply(self.machine.protocol_error(exc))
            return
        self._apply(self.machine.receive(message, _now_ms()))

    def _internal_error(self) -> None:
        """A bug of ours: say so, end the session with 1011; the server and other sessions carry on."""
        self._cancel_everything()
        self._control.append(ErrorEvent(message="Internal server error; the session is closed", code="internal_error",
                                        fatal=True))
        self._close = Close(CLOSE_INTERNAL_ERROR, "internal error")
        self._wake.set()

    def _on_writer_done(self, writer: asyncio.Task[None]) -> None:
        if writer.cancelled() or writer.exception() is None:
            return
        log.error("session %s: writer failed", self.session_id, exc_info=writer.exception())
        self._close = Close(CLOSE_INTERNAL_ERROR, "internal error")
        self._cancel_everything()
        if self._reader_task is not None:
            self._reader_task.cancel()

    def _receive_timeout(self) -> float:
        now = time.monotonic()
        if self.machine.config is None:
            return max(0.0, self._last_activity + self.settings.config_timeout_s - now)
        timeout = max(0.0, self._last_activity + self.settings.idle_timeout_s - now)
        deadline = self.machine.next_deadline_ms()
        if deadline is not None:
            timeout = min(timeout, max(0.0, (deadline - _now_ms()) / 1000.0))
        return timeout

    def _on_timer(self) -> None:
        now = time.monotonic()
        if self.machine.config is None:
            if now - self._last_activity >= self.settings.config_timeout_s:
                self._apply(self.machine.protocol_error(ProtocolError(
                    "config_timeout", "Timeout waiting for session.config", fatal=True)))
            return
        self._apply(self.machine.tick(_now_ms()))
        if now - self._last_activity >= self.settings.idle_timeout_s:
            if self._busy():
                self._last_activity = now
            else:
                self._apply(self.machine.protocol_error(ProtocolError(
                    "idle_timeout", "Idle timeout: no message received", fatal=True)))

    def _busy(self) -> bool:
        return bool(self._outq or self._control)

    @property
    def busy(self) -> bool:
        """Audio or events still to send."""
        return self._busy()

    async def shutdown(self, code: int, reason: str) -> None:
        """Server shutdown: cancel what is left and close the socket (which ends `run`)."""
        self._apply([Close(code, reason)])
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code=code, message=reason.encode()), 2.0)

    # -- actions --------------------------------------------------------------------------------

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send(event=event):
                    if isinstance(event, ErrorEvent):
                        self.ctx.metrics.errors.labels(event.code).inc()
                    self._emit(event)
                case Synthesize(unit=unit):
                    self._submit(unit)
                case FinishUtterance(utterance_index=index, total_sentences=total):
                    self._utterances.setdefault(index, UtteranceStats())
                    self._outq.append(FinishMarker(index, total))
                    self._wake.set()
                case CancelUtterance(utterance_index=index, context_id=context_id):
                    self._cancel_utterance(index, context_id)
                case Close():
                    self._close = action
                    self._cancel_everything()
                    self._wake.set()

    def _emit(self, event: ServerEvent) -> None:
        if len(self._control) >= self.settings.max_pending_events:
            self._close = Close(CLOSE_POLICY, "client stalled: too many unread events")
            self._cancel_everything()
        else:
            self._control.append(event)
        self._wake.set()

    def _submit(self, unit: Unit) -> None:
        stats = self._utterances.setdefault(unit.utterance_index, UtteranceStats())
        if stats.committed_first_ms is None:
            stats.committed_first_ms = unit.committed_ms
        config = unit.config
        renderer = UnitRenderer(render_plan(config, self.ctx.engine.info))
        job = UnitJob(unit, renderer, deadline_offset_s=stats.estimated_s)
        stats.estimated_s += len(unit.text) * SECONDS_PER_CHAR_ESTIMATE / config.speed
        self._outq.append(job)
        self._pump()

    def _pump(self) -> None:
        """Start synthesis for the earliest units while fewer than the cap are in flight."""
        in_flight = 0
        for item in self._outq:
            if not isinstance(item, UnitJob):
                continue
            if item.task is None:
                if in_flight >= self.settings.max_units_in_flight:
                    return
                item.task = asyncio.create_task(self._synthesize(item))
                self._unit_tasks.add(item.task)
                item.task.add_done_callback(self._unit_tasks.discard)
            in_flight += 1

    def _cancel_utterance(self, index: int, context_id: str | None) -> None:
        stats = self._utterances.pop(index, UtteranceStats())
        kept: deque[UnitJob | FinishMarker] = deque()
        for item in self._outq:
            owner = item.unit.utterance_index if isinstance(item, UnitJob) else item.utterance_index
            if owner != index:
                kept.append(item)
                continue
            if isinstance(item, UnitJob):
                self.ctx.metrics.units.labels("cancelled").inc()
                if item.task is not None:
                    item.task.cancel()
                if item.started_sent:
                    sent_ms = item.samples_sent * 1000.0 / item.unit.config.sample_rate
                    self._control.append(AudioDone(
                        utterance_index=index, sentence_index=item.unit.sentence_index,
                        total_bytes=item.bytes_sent, error=True, audio_ms=_ms(sent_ms)))
        self._outq = kept
        self._control.append(AudioCancelled(utterance_index=index, audio_ms=_ms(stats.audio_ms),
                                            context_id=context_id))
        self._wake.set()
        self._pump()

    def _cancel_everything(self) -> None:
        for item in self._outq:
            if isinstance(item, UnitJob) and item.task is not None:
                item.task.cancel()
        self._outq.clear()

    async def _await_unit_tasks(self) -> None:
        if self._unit_tasks:
            await asyncio.gather(*self._unit_tasks, return_exceptions=True)

    # -- synthesis ------------------------------------------------------------------------------

    async def _synthesize(self, job: UnitJob) -> None:
        unit = job.unit
        request = synthesis_request(f"{self.session_id}-{unit.utterance_index}-{unit.sentence_index}",
                                    unit.text, unit.config, job.renderer.plan)

        def sink(piece: RenderedPiece) -> None:
            job.outbox.append(piece)
            self._wake.set()

        try:
            self.engine_requests_started += 1
            job.engine_s = await synthesize_unit(self.ctx, request, job.renderer, self._deadline(job), sink)
        except asyncio.CancelledError:
            raise
        except UnitTimeout as exc:
            log.warning("unit %s: %s", request.request_id, exc)
            job.failure = ("unit_timeout", str(exc))
        except Exception as exc:
            log.exception("unit %s failed", request.request_id)
            job.failure = ("generation_failed", str(exc) or type(exc).__name__)
        finally:
            job.finished = True
            self._wake.set()

    def _deadline(self, job: UnitJob) -> float:
        """When the listener runs dry without this unit (monotonic seconds)."""
        stats = self._utterances.get(job.unit.utterance_index)
        if stats is None or stats.playback_start is None:
            return job.unit.committed_ms / 1000.0
        return stats.playback_start + job.deadline_offset_s

    # -- writer ---------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            if self._control:
                await self._send_event(self._control.popleft())
                continue
            if self._close is not None:
                return
            head = self._outq[0] if self._outq else None
            if isinstance(head, FinishMarker):
                self._outq.popleft()
                await self._finish_utterance(head)
                continue
            if head is not None and await self._advance(head):
                continue
            self._wake.clear()
            await self._wake.wait()

    async def _advance(self, job: UnitJob) -> bool:
        """Send the next thing of the head unit; False when there is nothing to send yet."""
        unit, config = job.unit, job.unit.config
        stats = self._utterances.setdefault(unit.utterance_index, UtteranceStats())
        if not job.started_sent:
            job.started_sent = True
            job.offset_ms = stats.audio_ms
            await self._send_event(AudioStart(
                utterance_index=unit.utterance_index, sentence_index=unit.sentence_index,
                sentence_text=unit.text, format=config.response_format,
                word_timestamps=config.word_timestamps, sample_rate=config.sample_rate, channels=1,
                context_id=unit.context_id))
            return True
        if job.outbox:
            piece = job.outbox.popleft()
            words = place_words(piece.words, unit.text, unit.char_start, job.offset_ms)
            job.words.extend(words)
            if words and config.word_timestamps and config.audio_frames == "binary":
                await self._send_event(AudioWords(utterance_index=unit.utterance_index,
                                                  sentence_index=unit.sentence_index, words=words))
            if piece.data:
                await self._send_audio(job, stats, piece)
            return True
        if not job.finished:
            return False
        self._outq.popleft()
        self._pump()
        if job.failure is not None:
            code, reason = job.failure
            self.ctx.metrics.units.labels("failed").inc()
            self.ctx.metrics.errors.labels(code).inc()
            partial = job.bytes_sent > 0
            await self._send_event(ErrorEvent(
                message=f"Generation failed for utterance {unit.utterance_index}, sentence "
                        f"{unit.sentence_index}: {reason}",
                code=code, fatal=False, partial_audio=True if partial else None,
                action="discard" if partial else None, utterance_index=unit.utterance_index,
                sentence_index=unit.sentence_index))
        else:
            self.ctx.metrics.units.labels("ok").inc()
            if config.word_timestamps and config.audio_frames == "json":
                await self._send_event(AudioChunk(
                    utterance_index=unit.utterance_index, sentence_index=unit.sentence_index,
                    chunk_id=job.chunk_id, chunk_start_ms=0, chunk_end_ms=round(job.renderer.audio_ms),
                    sample_rate=config.sample_rate, channels=1, audio_b64="",
                    timestamps=[_unit_relative(w, job.offset_ms) for w in job.words]))
        stats.engine_s += job.engine_s
        await self._send_event(AudioDone(
            utterance_index=unit.utterance_index, sentence_index=unit.sentence_index,
            total_bytes=job.bytes_sent, error=job.failure is not None, audio_ms=_ms(job.renderer.audio_ms)))
        return True

    async def _send_audio(self, job: UnitJob, stats: UtteranceStats, piece: RenderedPiece) -> None:
        unit, config = job.unit, job.unit.config
        if stats.first_audio_ms is None and stats.committed_first_ms is not None:
            stats.first_audio_ms = _now_ms() - stats.committed_first_ms
            stats.playback_start = time.monotonic()
            self.ctx.metrics.ttfa.labels("ws").observe(stats.first_audio_ms / 1000.0)
        start_ms = _ms(job.samples_sent * 1000.0 / config.sample_rate)
        job.samples_sent += piece.samples
        job.bytes_sent += len(piece.data)
        end_ms = job.samples_sent * 1000.0 / config.sample_rate
        stats.audio_ms = job.offset_ms + end_ms
        self.ctx.metrics.audio_seconds.labels("ws").inc(piece.samples / config.sample_rate)
        if config.audio_frames == "binary":
            await self._send(piece.data)
            return
        await self._send_event(AudioChunk(
            utterance_index=unit.utterance_index, sentence_index=unit.sentence_index, chunk_id=job.chunk_id,
            chunk_start_ms=round(start_ms), chunk_end_ms=round(end_ms), sample_rate=config.sample_rate,
            channels=1, audio_b64=base64.b64encode(piece.data).decode(), timestamps=None))
        job.chunk_id += 1

    async def _finish_utterance(self, marker: FinishMarker) -> None:
        stats = self._utterances.pop(marker.utterance_index, UtteranceStats())
        self.machine.utterance_finished(marker.utterance_index)
        await self._send_event(SessionDone(
            utterance_index=marker.utterance_index, total_sentences=marker.total_sentences,
            audio_ms=_ms(stats.audio_ms),
            timings=Timings(
                first_audio_ms=None if stats.first_audio_ms is None else round(stats.first_audio_ms, 2),
                engine_ms=round(stats.engine_s * 1000.0, 2))))

    async def _send_event(self, event: ServerEvent) -> None:
        await self._send(encode_event(event))

    async def _send(self, data: str | bytes) -> None:
        if self.ws.closed:
            return
        try:
            async with asyncio.timeout(self.settings.stall_timeout_s):
                if isinstance(data, bytes):
                    await self.ws.send_bytes(data)
                else:
                    await self.ws.send_str(data)
        except TimeoutError:
            log.warning("session %s: client stalled for %.0f s; closing", self.session_id,
                        self.settings.stall_timeout_s)
            self._close = Close(CLOSE_POLICY, "client stalled: not reading")
            self._cancel_everything()
            self._control.clear()
            if self._reader_task is not None:
                self._reader_task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(code=CLOSE_POLICY, message=b"client stalled"), 1.0)
        except ConnectionResetError:
            self._close = Close(1006, "connection lost")
            self._cancel_everything()
            self._control.clear()
        self._last_activity = time.monotonic()


def _unit_relative(word: WordTiming, offset_ms: float) -> WordTiming:
    return WordTiming(word=word.word, start_ms=round(word.start_ms - offset_ms),
                      end_ms=round(word.end_ms - offset_ms), char_start=word.char_start,
                      char_end=word.char_end)


def _ms(value: float) -> float:
    return round(value, 2)


def _now_ms() -> float:
    return time.monotonic() * 1000.0
