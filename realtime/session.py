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
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import WSMsgType, web
from voicewire.protocol.engine import UnitTimeout, failure_of
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
    decode_client_message,
    encode_event,
)
from voicewire.protocol.render import RenderedPiece, estimate_seconds, place_words
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
    message_type,
)
from voicewire.realtime.context import ServerContext
from voicewire.realtime.pipeline import UnitRun

log = logging.getLogger("voicewire.session")

CLOSE_INTERNAL_ERROR = 1011


@dataclass(slots=True, eq=False)
class UnitJob:
    """One unit from commit to `audio.done`: its synthesis (`run`, made when it starts synthesizing; a
    renderer's resampler is not free, so queued units hold none) and what of it was sent."""

    unit: Unit
    estimate_s: float
    """Expected audio duration, for the playback deadlines of the units behind it."""
    run: UnitRun | None = None
    started_sent: bool = False
    bytes_sent: int = 0
    samples_sent: int = 0
    chunk_id: int = 0
    unit_words: list[tuple[int, int, float, float]] = field(default_factory=list)
    """Words sent so far, on the unit's own timeline (for vllm-omni's trailing timestamps chunk)."""
    offset_ms: float = 0.0
    """Where the unit starts on the utterance timeline."""

    @property
    def sent_ms(self) -> float:
        return self.samples_sent * 1000.0 / self.unit.config.sample_rate


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


class SessionRuntime:
    """Serves one accepted WebSocket until it closes. Create, then `await run()`."""

    def __init__(self, ws: web.WebSocketResponse, ctx: ServerContext) -> None:
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
        self._writer_task: asyncio.Task[None] | None = None
        self._control_room = asyncio.Event()
        self._control_room.set()
        self._dry_at: float | None = None
        """Monotonic time at which the listener will have played all audio sent so far."""
        self.engine_requests_started = 0

    # -- reader ---------------------------------------------------------------------------------

    async def run(self) -> None:
        writer = self._writer_task = asyncio.create_task(self._write_loop(), name=f"{self.session_id}-writer")
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
                # Our own timeout, not receive(timeout=): aiohttp restarts that one after every pong it
                # swallows (heartbeat every 20 s), so the 30 s idle timeout never fired, and it treats 0
                # as "no timeout", so a deadline already due waited for the next message.
                async with asyncio.timeout(timeout):
                    msg = await self.ws.receive()
            except TimeoutError:
                try:
                    self._on_timer()
                except Exception:
                    log.exception("session %s: internal error on a timer", self.session_id)
                    self._internal_error()
                continue
            if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                return
            self._last_activity = time.monotonic()
            try:
                if msg.type is WSMsgType.TEXT:
                    self._on_text(msg.data)
                else:
                    self._apply(self.machine.protocol_error(ProtocolError(
                        "binary_not_supported", "Binary frames are not accepted; send JSON text frames")))
            except Exception:
                log.exception("session %s: internal error handling a message", self.session_id)
                self._internal_error()
            # Backpressure on events: a client that makes us queue many events (errors, say) without
            # reading them is not read from until the writer catches up (or the send stalls and closes).
            while len(self._control) >= self.settings.max_pending_events and self._close is None:
                self._control_room.clear()
                await self._control_room.wait()

    def _on_text(self, data: str) -> None:
        try:
            message = decode_client_message(data)
            limit = (self.settings.max_config_bytes if isinstance(message, SessionConfig)
                     else self.settings.max_message_bytes)
            if len(data) > limit // 4 and len(data.encode()) > limit:
                raise ProtocolError("message_too_large", f"{message_type(message)} message too large")
        except ProtocolError as exc:
            self._apply(self.machine.protocol_error(exc))
            return
        self._apply(self.machine.receive(message, _now_ms()))

    def _internal_error(self) -> None:
        """A bug of ours: say so, end the session with 1011; the server and other sessions carry on."""
        self._cancel_everything()
        self._emit(ErrorEvent(message="Internal server error; the session is closed", code="internal_error",
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
            if self.busy:
                self._last_activity = now
            else:
                self._apply(self.machine.protocol_error(ProtocolError(
                    "idle_timeout", "Idle timeout: no message received", fatal=True)))

    @property
    def busy(self) -> bool:
        """Audio or events still to send."""
        return bool(self._outq or self._control)

    async def shutdown(self, code: int, reason: str) -> None:
        """Server shutdown: cancel what is left (closing started units with their `audio.done`), give the
        writer a moment to send that, then close the socket (which ends `run`)."""
        self._apply([Close(code, reason)])
        if self._writer_task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._writer_task), 2.0)
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
                    self._drop_units(lambda _index: True)
                    self._control_room.set()
                    self._wake.set()

    def _emit(self, event: ServerEvent) -> None:
        self._control.append(event)
        self._wake.set()

    def _submit(self, unit: Unit) -> None:
        stats = self._utterances.setdefault(unit.utterance_index, UtteranceStats())
        if stats.committed_first_ms is None:
            stats.committed_first_ms = unit.committed_ms
        self._outq.append(UnitJob(unit, estimate_seconds(unit.text, unit.config)))
        self._pump()

    def _pump(self) -> None:
        """Start synthesis for the earliest units while fewer than the cap are in flight."""
        in_flight = 0
        for item in self._outq:
            if not isinstance(item, UnitJob):
                continue
            if item.run is None:
                if in_flight >= self.settings.max_units_in_flight:
                    return
                self._start(item)
            in_flight += 1

    def _cancel_utterance(self, index: int, context_id: str | None) -> None:
        stats = self._utterances.pop(index, UtteranceStats())
        self._drop_units(lambda owner: owner == index)
        self._emit(AudioCancelled(utterance_index=index, audio_ms=_ms(stats.audio_ms), context_id=context_id))
        self._pump()

    def _drop_units(self, drop: Callable[[int], bool], *, announce: bool = True) -> None:
        """Stop the units (and utterance ends) of the utterances `drop` selects; with `announce`, a unit whose
        `audio.start` went out gets its `audio.done` (error: true), so the two always pair."""
        kept: deque[UnitJob | FinishMarker] = deque()
        for item in self._outq:
            owner = item.unit.utterance_index if isinstance(item, UnitJob) else item.utterance_index
            if not drop(owner):
                kept.append(item)
                continue
            if isinstance(item, UnitJob):
                self.ctx.metrics.units.labels("cancelled").inc()
                if item.run is not None:
                    item.run.task.cancel()
                if announce and item.started_sent:
                    self._emit(AudioDone(
                        utterance_index=owner, sentence_index=item.unit.sentence_index,
                        total_bytes=item.bytes_sent, error=True, audio_ms=_ms(item.sent_ms)))
        self._outq = kept

    def _cancel_everything(self) -> None:
        """Stop every unit, saying nothing (the session is ending)."""
        self._drop_units(lambda _: True, announce=False)

    async def _await_unit_tasks(self) -> None:
        if self._unit_tasks:
            await asyncio.gather(*self._unit_tasks, return_exceptions=True)

    # -- synthesis ------------------------------------------------------------------------------

    def _start(self, job: UnitJob) -> None:
        unit = job.unit
        run = job.run = UnitRun.start(self.ctx, f"{self.session_id}-{unit.utterance_index}-{unit.sentence_index}",
                                      unit.text, unit.config, unit.params, self._deadline(job), self._wake.set)
        self.engine_requests_started += 1
        self._unit_tasks.add(run.task)
        run.task.add_done_callback(self._unit_tasks.discard)
        run.task.add_done_callback(lambda _: _log_failure(run))

    def _deadline(self, job: UnitJob) -> float:
        """When the listener runs dry without this unit (monotonic seconds): once the audio already sent
        and the expected audio of the units ahead of it have played. Never earlier than the unit's commit
        time, so a session's backlog cannot jump ahead of another session's first unit."""
        committed = job.unit.committed_ms / 1000.0
        if self._dry_at is None:
            return committed
        ahead = 0.0
        for item in self._outq:
            if item is job:
                break
            if isinstance(item, UnitJob):
                ahead += max(0.0, item.estimate_s - item.sent_ms / 1000.0)
        return max(committed, self._dry_at + ahead)

    # -- writer ---------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            if self._control:
                await self._send_event(self._control.popleft())
                if len(self._control) < self.settings.max_pending_events:
                    self._control_room.set()
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
        run = job.run
        if run is not None and run.outbox:
            piece = run.outbox.popleft()
            if config.word_timestamps and config.audio_frames == "json":
                job.unit_words.extend(piece.words)
            if piece.words and config.word_timestamps and config.audio_frames == "binary":
                words = place_words(piece.words, unit.text, unit.char_start, job.offset_ms)
                await self._send_event(AudioWords(utterance_index=unit.utterance_index,
                                                  sentence_index=unit.sentence_index, words=words))
                if not self._outq or self._outq[0] is not job:
                    return True  # cancelled while that was sent: nothing more of it goes out
            if piece.data:
                await self._send_audio(job, stats, piece)
            return True
        if run is None or not run.done:
            return False
        self._outq.popleft()
        self._pump()
        failure = _failure(run)
        if failure is not None:
            code, reason = failure
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
                    chunk_id=job.chunk_id, chunk_start_ms=0, chunk_end_ms=round(job.sent_ms),
                    sample_rate=config.sample_rate, channels=1, audio_b64="",
                    timestamps=place_words(job.unit_words, unit.text, unit.char_start, 0.0)))
        stats.engine_s += run.engine_s
        await self._send_event(AudioDone(
            utterance_index=unit.utterance_index, sentence_index=unit.sentence_index,
            total_bytes=job.bytes_sent, error=failure is not None, audio_ms=_ms(job.sent_ms)))
        return True

    async def _send_audio(self, job: UnitJob, stats: UtteranceStats, piece: RenderedPiece) -> None:
        unit, config = job.unit, job.unit.config
        now = time.monotonic()
        if stats.first_audio_ms is None and stats.committed_first_ms is not None:
            stats.first_audio_ms = now * 1000.0 - stats.committed_first_ms
            self.ctx.metrics.ttfa.labels("ws").observe(stats.first_audio_ms / 1000.0)
        self._dry_at = max(self._dry_at or now, now) + piece.samples / config.sample_rate
        start_ms = _ms(job.sent_ms)
        job.samples_sent += piece.samples
        job.bytes_sent += len(piece.data)
        end_ms = job.sent_ms
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


def _failure(run: UnitRun) -> tuple[str, str] | None:
    """(error code, reason) of a failed unit; None when it succeeded."""
    return None if run.error is None else failure_of(run.error)


def _log_failure(run: UnitRun) -> None:
    """Log a unit's failure when it happens (the writer may never get to report it: the session can close
    first)."""
    if isinstance(run.error, UnitTimeout):
        log.warning("unit %s: %s", run.task.get_name(), run.error)
    elif run.error is not None:
        log.error("unit %s failed", run.task.get_name(), exc_info=run.error)


def _ms(value: float) -> float:
    return round(value, 2)


def _now_ms() -> float:
    return time.monotonic() * 1000.0
