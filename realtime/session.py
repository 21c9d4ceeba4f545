"""The runtime of one WebSocket session: moves bytes and awaits engines; decisions live in `protocol`.

Three kinds of task per session:
- the reader (one per connection) decodes frames, feeds `SessionMachine` and carries out its actions at
  once; it never awaits synthesis or a send, so `input.cancel` and `session.close` act while audio streams;
- one synthesis task per unit in flight, admitted by the shared `Scheduler` (`realtime.pipeline.UnitRuns`);
  it feeds the rendered pieces to the session's `protocol.output.OutputMachine`;
- the writer (one per session, it outlives connections), the only task that sends: it numbers what the
  `OutputMachine` hands out into the session's `protocol.resume.ReplayLog` (control events first, then
  units strictly in order, each as `audio.start`, audio (and words), `audio.done`, and `session.done` after
  an utterance's last unit) and sends the log's frames to the connection in order.

Resume: a session whose client acknowledges frames (`session.ack`) outlives its connection. When the socket
drops (or stalls) without `session.close`, the session waits `resume_window_s` for `session.resume` on a
new connection (`resume`): the units in flight finish into the replay log (no new unit starts: a waiting
session holds no engine slot beyond those), and nothing is sent. A resume replays the frames after the
last one the client received, then the stream goes on live; a second resume takes over and closes the
first connection. Past the window the session ends as if the socket had closed.

Bounds: at most `max_units_in_flight` units are synthesizing or waiting to be sent, so a client that
stops reading pauses its own synthesis and holds at most that many units of audio; control events
queued for such a client are capped (`max_pending_events`), and a send blocked past `stall_timeout_s`
closes the session with 1008 (or, for a resumable session, drops the connection and waits for a resume).
The replay log holds at most `replay_buffer_bytes` (plus one frame); a resumable session produces no
frame past it until the client acknowledges, which pauses its synthesis the same way. The reader lets the
event loop run other sessions after every `READ_BUDGET_PER_TURN` worth of messages, so a flooding client
cannot hold it. Cancel and the end of a session cancel the unit tasks, which closes the engine iterators
(the engine's only cancel API).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from aiohttp import WSMessage, WSMsgType, web
from voicewire.protocol.messages import (
    ErrorEvent,
    ProtocolError,
    SessionAck,
    SessionConfig,
    SessionDone,
    SessionResume,
    SessionResumed,
    decode_client_message,
    encode_event,
    encode_event_bytes,
    error_event,
)
from voicewire.protocol.output import Frame, OutputMachine
from voicewire.protocol.render import RenderedPiece, estimate_seconds
from voicewire.protocol.resume import ReplayLog, stamp
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
from voicewire.realtime.frames import write_frames
from voicewire.realtime.pipeline import UnitRuns, decode_reference, needs_reference

log = logging.getLogger("voicewire.session")

CLOSE_INTERNAL_ERROR = 1011
TIMER_RESOLUTION_S = 0.002
"""A read timeout that fires this close to the deadline counts as due (uvloop's timers tick in ms)."""
READ_BUDGET_PER_TURN = 16
"""How much the reader handles before it lets the event loop run everything else (every session shares
it): a message counts 1, plus 1 per 4 KiB of its text. aiohttp hands over frames already buffered without
suspending, so without this a client that sends thousands of tiny frames at once held the loop for all of
them (issue 14 #5)."""

SEQ_FIELDS_BYTES = 40
"""What `stamp` adds to an event, at most (counted in the replay log's bytes)."""


@dataclass(slots=True, eq=False)
class Connection:
    """One WebSocket serving a session: `sent` is the number of the last frame sent on it."""

    ws: web.WebSocketResponse
    transport: asyncio.BaseTransport | None
    """The TCP connection under `ws` (to drop one whose peer is gone without a close handshake)."""
    sent: int = 0
    reader: asyncio.Task[None] | None = None
    gone: bool = False
    """Taken over by a resume, or lost: nothing more is sent on it."""
    taken_over: bool = False
    ready: bool = True
    """A resumed connection is sent to only once `session.resumed` went out on it."""
    closed_on_purpose: bool = False
    """It ended with a close frame (the client's or ours), not by breaking."""


class SessionRuntime:
    """Serves one session: create with its first socket, then `await run()`; a resumed connection is
    served by `resume`. `on_end(self)` is called once when the session ends (not when a resumable one
    only loses its connection)."""

    def __init__(self, ws: web.WebSocketResponse, ctx: ServerContext, *, key: str | None = None,
                 transport: asyncio.BaseTransport | None = None,
                 on_end: Callable[[SessionRuntime], None] = lambda _runtime: None,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.ws = ws
        """The socket the session was opened on."""
        self._transport = transport
        self.ctx = ctx
        self.settings = ctx.settings
        self.scheduler = ctx.scheduler
        self.session_id = ctx.next_session_id()
        token = ctx.resumes.register(self.session_id, key, self)
        self.machine = SessionMachine(ctx.facts, self.session_id, token)
        self.output = OutputMachine(self.settings.max_units_in_flight)
        self.replay = ReplayLog(self.settings.replay_buffer_bytes)
        self.input_seq = 0
        """Client messages applied (every text or binary frame but `session.ack` and `session.resume`)."""
        self._wake = asyncio.Event()
        self._runs = UnitRuns(ctx, self.output, functools.partial(unit_request_id, self.session_id), "ws",
                              self._wake.set)
        self._conn: Connection | None = None
        self._close: Close | None = None
        self._on_end = on_end
        self._draining = draining
        """True once the server is shutting down: a connection lost then ends the session."""
        self._ended = False
        self._expiry: asyncio.TimerHandle | None = None
        self._blocked_since: float | None = None
        """When the writer began waiting for the client's acknowledgement (replay log full)."""
        self._last_activity = time.monotonic()
        self._writer_task: asyncio.Task[None] | None = None
        self._control_room = asyncio.Event()
        self._control_room.set()
        self.messages_received = 0
        """Client frames read (text and binary): tests watch how many go by per turn of the loop."""
        self._read_budget = READ_BUDGET_PER_TURN
        self._needs_reference: SessionConfig | None = None
        """A `session.config` read whose `ref_audio` the reader decodes before it takes the next message."""

    @property
    def engine_requests_started(self) -> int:
        return self._runs.started

    @property
    def waiting(self) -> bool:
        """The connection dropped and the session waits for a resume."""
        return self._conn is None and not self._ended

    # -- connections ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the socket the session was opened on, until it closes; a resumable session may live on
        after (`waiting`)."""
        writer = self._writer_task = asyncio.create_task(self._write_loop(), name=f"{self.session_id}-writer")
        writer.add_done_callback(self._on_writer_done)
        await self._serve(Connection(self.ws, self._transport))

    async def resume(self, ws: web.WebSocketResponse, transport: asyncio.BaseTransport | None,
                     request: SessionResume) -> None:
        """Serve `ws`, whose client sent `request` (its token and key already checked by the registry):
        answer `session.resumed`, replay the frames after `request.seq`, then go on live. `request.seq`
        acknowledges the frames up to it (the client says it has them), so a session that stopped producing
        for want of an ack goes on. A connection still attached is taken over: it gets an `error`
        (`session_taken_over`) and is closed with 1008. Raises `ProtocolError` (`resume_gap`) when frames the
        client lacks are no longer kept."""
        if self._ended or self._close is not None:
            raise ProtocolError("resume_expired", f"Cannot resume session {self.session_id!r}: it is ending",
                                fatal=True)
        self.replay.check_resume(request.seq)
        self.replay.ack(request.seq)
        old = self._conn
        if old is not None:
            self._take_over(old)  # no message of the old connection is applied after this
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.ctx.resumes.attached(self.session_id)
        # Attached at once (a second resume racing this one takes it over), sent to once it is answered.
        conn = self._conn = Connection(ws, transport, sent=request.seq, ready=False)
        replay_bytes = sum(_size(self.replay.frame(n)) for n in range(request.seq + 1, self.replay.last_seq + 1))
        try:
            async with asyncio.timeout(self.settings.stall_timeout_s):
                await ws.send_str(encode_event(SessionResumed(
                    session_id=self.session_id, seq=request.seq, input_seq=self.input_seq,
                    replay_frames=self.replay.last_seq - request.seq, replay_bytes=replay_bytes)))
        except Exception:
            if not conn.taken_over:  # this connection died too: wait for the next resume
                conn.gone = True
                self._conn = None
                self._wait_for_resume()
            return
        if conn.taken_over:
            return
        metrics = self.ctx.metrics
        metrics.resumes_succeeded.inc()
        metrics.replayed_bytes.inc(replay_bytes)
        conn.ready = True
        self._last_activity = time.monotonic()
        self._runs.hold = False
        self._settle()
        await self._serve(conn)

    async def _serve(self, conn: Connection) -> None:
        self._conn = conn
        self._wake.set()
        reader = conn.reader = asyncio.create_task(self._read_loop(conn), name=f"{self.session_id}-reader")
        try:
            await reader
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # The handler is cancelled: aiohttp does that when the client's TCP connection is lost
                # (`handler_cancellation`), and at shutdown.
                # The reader may have read the client's close frame already (aiohttp closes the
                # transport as it answers one, so this cancellation can follow a close on purpose).
                reader.cancel()
                if not conn.taken_over:
                    if self._broke(conn):
                        self._detach(conn)
                    else:
                        await self._end()
                raise
        if conn.taken_over:
            return
        if self._broke(conn):
            self._detach(conn)
            return
        await self._end()

    def _broke(self, conn: Connection) -> bool:
        """Whether the end of `conn` leaves the session waiting for a resume: the connection broke (no
        `session.close`, no close frame either way, no fatal error) and the session is resumable."""
        return self._close is None and not conn.closed_on_purpose and self._resumable()

    def _resumable(self) -> bool:
        return (self.replay.acknowledged and self.settings.resume_window_s > 0 and not self._draining()
                and self.machine.config is not None and not self._ended)

    def _take_over(self, old: Connection) -> None:
        """A resume on another connection: stop reading and sending on `old`, tell its client why, close it."""
        old.gone = old.taken_over = True
        if old.reader is not None:
            old.reader.cancel()
        self._conn = None

        async def close_old() -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await old.ws.send_str(encode_event(ErrorEvent(
                        message="This session was resumed on another connection; this one is closed",
                        code="session_taken_over", fatal=True)))
                    await old.ws.close(code=CLOSE_POLICY, message=b"session taken over")
            if not old.ws.closed:
                _abort(old)

        self.ctx.spawn(close_old(), f"{self.session_id}-takeover")

    def _detach(self, conn: Connection) -> None:
        """The connection dropped: wait for a resume."""
        conn.gone = True
        if self._conn is conn:
            self._conn = None
        if not conn.ws.closed:
            _abort(conn)
        log.info("session %s: connection lost; waiting %.0f s for a resume", self.session_id,
                 self.settings.resume_window_s)
        self._wait_for_resume()

    def _wait_for_resume(self) -> None:
        """Keep the session for `resume_window_s`: its units in flight finish into the replay log, no other
        unit starts, and it ends when the window passes without a resume."""
        self._runs.hold = True
        self.ctx.resumes.detached(self.session_id, time.monotonic())
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(self.settings.resume_window_s, self._expire)
        self._wake.set()

    def _expire(self) -> None:
        self._expiry = None
        for runtime in self.ctx.resumes.expired(time.monotonic()):
            self.ctx.metrics.resumes_expired.inc()
            self.ctx.spawn(runtime._end(), f"{runtime.session_id}-expired")

    async def _end(self) -> None:
        """End the session: stop its units, let the writer flush what a close leaves (up to the stall
        timeout), close the socket, and report the end once."""
        if self._ended:
            return
        self._ended = True
        self.ctx.resumes.ended(self.session_id, self._end_reason(), time.monotonic())
        if self._expiry is not None:
            self._expiry.cancel()
        self._stop_units()
        writer = self._writer_task
        conn = self._conn
        try:
            if writer is not None:
                if self._close is not None and conn is not None and not writer.done():
                    self._wake.set()
                    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                        await asyncio.wait_for(asyncio.shield(writer), self.settings.stall_timeout_s)
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
            await self._runs.aclose()
            if conn is not None and not conn.ws.closed:
                code, reason = (self._close.code, self._close.reason) if self._close else (1000, "")
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.ws.close(code=code, message=reason.encode()[:120]), 2.0)
        finally:
            self._on_end(self)

    def _end_reason(self) -> str:
        if self._close is None:
            return "ended when its connection closed"
        if self._close.reason == "session.close":
            return "was closed with session.close"
        return f"ended ({self._close.reason or self._close.code})"

    # -- reader ---------------------------------------------------------------------------------

    async def _read_loop(self, conn: Connection) -> None:
        while self._close is None and not conn.gone:
            due = await self._read_until_due(conn)
            if due is None:
                return
            if not due:
                continue
            try:
                self._on_timer()
            except Exception:
                log.exception("session %s: internal error on a timer", self.session_id)
                self._internal_error()

    async def _read_until_due(self, conn: Connection) -> bool | None:
        """Handle messages until the connection ends (None) or the timer fires: True when the next
        deadline (config, idle or segmenter) is due, False when it moved later meanwhile.

        Our own timeout, not receive(timeout=): aiohttp restarts that one after every pong it swallows
        (heartbeat every 20 s), so the 30 s idle timeout never fired, and it treats 0 as "no timeout", so a
        deadline already due waited for the next message. One timeout serves many messages: it is moved
        only when the next deadline comes earlier than it is set for; one that fires before the deadline
        (which moved later meanwhile, as the idle deadline does with every message) is set again. It is
        disarmed while the reader waits for anything but a message (backpressure, its turn, a reference
        decode)."""
        ws = conn.ws
        loop = asyncio.get_running_loop()
        receiving = False
        try:
            async with asyncio.timeout(None) as timer:
                while self._close is None and not conn.gone:
                    due = loop.time() + self._receive_timeout()
                    when = timer.when()
                    if when is None or due < when:
                        timer.reschedule(due)
                    receiving = True
                    msg = await ws.receive()
                    receiving = False
                    if self._handle(conn, msg):
                        return None
                    if self._needs_reference is not None or self._must_pause():
                        timer.reschedule(None)
                        await self._after_message()
                return None
        except TimeoutError:
            if not receiving:
                raise  # not ours: the timer is disarmed outside receive()
            return self._receive_timeout() <= TIMER_RESOLUTION_S

    def _handle(self, conn: Connection, msg: WSMessage) -> bool:
        """One received message, applied without awaiting anything (what must wait is left to
        `_after_message`); True when it ends the connection."""
        if msg.type is not WSMsgType.TEXT and msg.type is not WSMsgType.BINARY:
            # A close frame from the client, or our own close: the connection ended on purpose. Only a
            # connection that broke (CLOSED, ERROR) leaves a resumable session waiting.
            conn.closed_on_purpose = msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING)
            return True
        self._last_activity = time.monotonic()
        self.messages_received += 1
        data = msg.data
        try:
            if msg.type is WSMsgType.TEXT:
                self._on_text(data)
            else:
                self.input_seq += 1
                self._apply(self.machine.protocol_error(ProtocolError(
                    "binary_not_supported", "Binary frames are not accepted; send JSON text frames")))
        except Exception:
            log.exception("session %s: internal error handling a message", self.session_id)
            self._internal_error()
        self._read_budget -= 1 + len(data) // 4096
        return False

    def _must_pause(self) -> bool:
        """Whether the reader must wait before the next message: for the writer (backpressure on events) or
        for its turn (`READ_BUDGET_PER_TURN`)."""
        return self._read_budget <= 0 or (self.output.pending_events >= self.settings.max_pending_events
                                          and self._close is None)

    async def _after_message(self) -> None:
        """What a message leaves to wait for, in order: the decode of a `session.config`'s `ref_audio`
        (`_on_text`), then backpressure on events (a client that makes us queue many events, errors say,
        without reading them is not read from until the writer catches up, or the send stalls and closes),
        then the reader's turn (`READ_BUDGET_PER_TURN`)."""
        message, self._needs_reference = self._needs_reference, None
        if message is not None:
            try:
                reference = await asyncio.to_thread(decode_reference, self.ctx, message.ref_audio or "")
            except ProtocolError as exc:
                self._apply(self.machine.protocol_error(exc))
            else:
                try:
                    self._apply(self.machine.receive(message, _now_ms(), reference=reference))
                except Exception:
                    log.exception("session %s: internal error handling a message", self.session_id)
                    self._internal_error()
        while self.output.pending_events >= self.settings.max_pending_events and self._close is None:
            self._control_room.clear()
            await self._control_room.wait()
        if self._read_budget <= 0:
            self._read_budget = READ_BUDGET_PER_TURN
            await asyncio.sleep(0)

    def _on_text(self, data: str) -> None:
        """Apply one text frame. A `session.config` whose `ref_audio` must be decoded is left in
        `_needs_reference` for `_after_message`, which decodes it in a worker thread before the machine sees
        the config (the reader takes no other message meanwhile, so messages still apply in order): audio
        that does not decode refuses the config by name, and its units never decode it again."""
        try:
            message = decode_client_message(data)
            limit = (self.settings.max_config_bytes if isinstance(message, SessionConfig)
                     else self.settings.max_message_bytes)
            if len(data) > limit // 4 and len(data.encode()) > limit:
                raise ProtocolError("message_too_large", f"{message_type(message)} message too large")
        except ProtocolError as exc:
            self.input_seq += 1
            self._apply(self.machine.protocol_error(exc))
            return
        if isinstance(message, SessionAck):
            self._ack(message.seq)
            return
        if isinstance(message, SessionResume):
            self._apply(self.machine.protocol_error(ProtocolError(
                "resume_not_allowed", "session.resume must be the first message of a new connection opened "
                "with ?session_id=<the session's id>")))
            return
        self.input_seq += 1
        if (isinstance(message, SessionConfig) and self.machine.legal(message)
                and needs_reference(self.ctx, message)):
            self._needs_reference = message
            return
        self._apply(self.machine.receive(message, _now_ms()))

    def _ack(self, seq: int) -> None:
        if self.settings.resume_window_s <= 0:
            return  # resume is off: the log stays a ring of sent frames
        try:
            self.replay.ack(seq)
        except ProtocolError as exc:
            self._apply(self.machine.protocol_error(exc))
            return
        self._blocked_since = None
        self._wake.set()

    def _internal_error(self) -> None:
        """A bug of ours: say so, end the session with 1011; the server and other sessions carry on."""
        self._terminate(Close(CLOSE_INTERNAL_ERROR, "internal error"))
        self.output.emit(ErrorEvent(message="Internal server error; the session is closed", code="internal_error",
                                    fatal=True))

    def _on_writer_done(self, writer: asyncio.Task[None]) -> None:
        if writer.cancelled() or writer.exception() is None:
            return
        log.error("session %s: writer failed", self.session_id, exc_info=writer.exception())
        self._terminate(Close(CLOSE_INTERNAL_ERROR, "internal error"))
        conn = self._conn
        if conn is not None and conn.reader is not None:
            conn.reader.cancel()
        elif not self._ended:
            self.ctx.spawn(self._end(), f"{self.session_id}-end")

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
        """Audio or events still to send to a connected client."""
        conn = self._conn
        return conn is not None and (self.output.busy or conn.sent < self.replay.last_seq)

    @property
    def settled(self) -> bool:
        """Nothing to send and no utterance open or unfinished: closing the session now loses nothing the
        client sent (every utterance it started has had its `session.done` or `audio.cancelled`, and the
        connection, if any, has been sent every frame of the replay log)."""
        conn = self._conn
        return (not self.output.busy and not self.machine.active_utterances
                and (conn is None or conn.sent >= self.replay.last_seq))

    async def shutdown(self, code: int, reason: str) -> None:
        """Server shutdown: cancel what is left (closing started units with their `audio.done`), give the
        writer a moment to send that, then close the socket (which ends the session). A session waiting for
        a resume just ends."""
        self._apply([Close(code, reason)])
        conn = self._conn
        if conn is None:
            await self._end()
            return
        if self._writer_task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._writer_task), 2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.ws.close(code=code, message=reason.encode()), 2.0)

    # -- actions --------------------------------------------------------------------------------

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send(event=event):
                    if isinstance(event, ErrorEvent):
                        self.ctx.metrics.errors.labels(event.code).inc()
                    self.output.emit(event)
                case Synthesize(unit=unit):
                    self.output.commit(unit, estimate_seconds(unit.text, unit.config) * 1000.0)
                    self._settle()
                case FinishUtterance(utterance_index=index, total_sentences=total):
                    self.output.finish_utterance(index, total)
                case CancelUtterance(utterance_index=index, context_id=context_id):
                    self.output.cancel_utterance(index, context_id)
                    self._settle()
                case Close():
                    self._terminate(action, announce=True)
        if actions:
            self._wake.set()

    def _settle(self) -> None:
        """Start the units the output made due; count those that ended (`UnitRuns` counts the rest)."""
        for out in self._runs.settle():
            if out.failure is not None:
                self.ctx.metrics.errors.labels(out.failure[0]).inc()
            if out.first_audio_ms is not None:
                self.ctx.metrics.ttfa.labels("ws").observe(out.first_audio_ms / 1000.0)

    def _terminate(self, close: Close, *, announce: bool = False) -> None:
        """Begin the session's end, the one path for every cause (a `Close` action of the machine, server
        shutdown through it, a bug of ours, a writer that failed, a client lost or stalled): record `close`
        (the code and reason the socket closes with; the reader takes no further message), stop every unit,
        and wake the reader and the writer. With `announce`, started units still get their `audio.done`;
        without, nothing more is said of them. Control events already queued stay. `_end` finishes the job
        (the writer's last flush, the socket's close, `on_end`)."""
        self._close = close
        self._stop_units(announce=announce)
        self._control_room.set()
        self._wake.set()

    def _stop_units(self, *, announce: bool = False) -> None:
        """Stop every unit; with `announce`, started ones get their `audio.done` (error)."""
        self.output.close(announce=announce)
        self._settle()

    # -- writer ---------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        """Send the replay log's frames to the connection in order; number the next frame the output hands
        out into the log when everything recorded went out (or, without a connection, while the log has
        room), and with it the frames the output has ready at once, as long as all of them go out in one
        write (`_send_recorded`)."""
        output, replay = self.output, self.replay
        room = self._control_room
        max_pending = self.settings.max_pending_events
        while True:
            conn = self._conn
            if conn is not None and conn.ready and conn.sent < replay.last_seq:
                await self._send_recorded(conn)
                continue
            frame = None
            if replay.room:
                self._blocked_since = None
                frame = output.next_output(_now_ms())
                self._settle()
            elif conn is not None and conn.ready and self._stalled_on_acks():
                continue
            if frame is None:
                if self._close is not None and (conn is None or not conn.ready or conn.sent >= replay.last_seq):
                    return
                self._wake.clear()
                await self._wait()
                continue
            self._record(frame)
            if conn is not None and conn.ready and conn.sent < replay.last_seq:
                self._record_ready(conn)
            if not room.is_set() and output.pending_events < max_pending:
                room.set()

    def _record_ready(self, conn: Connection) -> None:
        """Record the frames the output has ready now, behind those recorded and not yet sent on `conn`, while
        all of them still fit the socket's buffer unpaused (`_fits_unpaused`): they go out in one write."""
        output, replay = self.output, self.replay
        size = _wire_size([replay.frame(seq) for seq in range(conn.sent + 1, replay.last_seq + 1)])
        while replay.room and _fits_unpaused(conn, size):
            frame = output.next_output(_now_ms())
            self._settle()
            if frame is None:
                return
            self._record(frame)
            size += _wire_size([replay.frame(replay.last_seq)]) + FRAME_HEADER_MAX

    async def _send_recorded(self, conn: Connection) -> None:
        """Send on `conn` the frames recorded and not yet sent on it: several in one write when the socket
        takes them all at once (`frames.write_frames`: a system call each costs the loop more than the frame's
        bytes), else the next one on its own, through aiohttp, which waits for a socket that does not."""
        replay = self.replay
        first, last = conn.sent + 1, replay.last_seq
        transport = cast("asyncio.WriteTransport | None", conn.transport)
        if (last > first and transport is not None and not transport.is_closing() and not conn.ws.compress
                and not conn.gone and not conn.ws.closed):
            frames = [replay.frame(seq) for seq in range(first, last + 1)]
            if _fits_unpaused(conn, _wire_size(frames)):
                write_frames(transport, frames)
                conn.sent = max(conn.sent, last)
                replay.sent(last)
                self._last_activity = time.monotonic()
                return
        await self._send(conn, replay.frame(first))
        conn.sent = max(conn.sent, first)
        replay.sent(first)

    async def _wait(self) -> None:
        """Wait for a wake-up; while blocked on acknowledgements, no longer than the stall timeout."""
        if self._blocked_since is None:
            await self._wake.wait()
            return
        left = self._blocked_since + self.settings.stall_timeout_s - time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, left)):
                await self._wake.wait()

    def _stalled_on_acks(self) -> bool:
        """The log is full and the client does not acknowledge: after the stall timeout, treat the
        connection like one that stopped reading. True when that happened."""
        now = time.monotonic()
        if self._blocked_since is None:
            self._blocked_since = now
            return False
        if now - self._blocked_since < self.settings.stall_timeout_s or self._conn is None:
            return False
        self._blocked_since = None
        self._lost(self._conn, stalled=True)
        return True

    def _record(self, frame: Frame) -> None:
        if isinstance(frame, RenderedPiece):
            self.replay.record(frame.data)
            return
        if type(frame) is SessionDone:
            self.machine.utterance_finished(frame.utterance_index)
        raw = encode_event_bytes(frame)
        self.replay.record(stamp(raw, self.replay.last_seq + 1, self.input_seq), len(raw) + SEQ_FIELDS_BYTES)

    async def _send(self, conn: Connection, data: str | bytes) -> None:
        if conn.gone or conn.ws.closed:
            if not conn.gone:
                self._lost(conn, stalled=False)
            return
        try:
            if _fits_unpaused(conn, len(data) if isinstance(data, bytes) else 4 * len(data)):
                # cannot wait for the client: no timeout to arm (one per frame was a measurable cost)
                if isinstance(data, bytes):
                    await conn.ws.send_bytes(data)
                else:
                    await conn.ws.send_str(data)
            else:
                async with asyncio.timeout(self.settings.stall_timeout_s):
                    if isinstance(data, bytes):
                        await conn.ws.send_bytes(data)
                    else:
                        await conn.ws.send_str(data)
        except TimeoutError:
            log.warning("session %s: client stalled for %.0f s", self.session_id, self.settings.stall_timeout_s)
            self._lost(conn, stalled=True)
        except ConnectionResetError:
            self._lost(conn, stalled=False)
        self._last_activity = time.monotonic()

    def _lost(self, conn: Connection, *, stalled: bool) -> None:
        """Sending on `conn` failed (the peer is gone) or stalled. A resumable session drops the connection
        and waits for a resume; any other ends (1008 "client stalled", or 1006)."""
        if conn.gone:
            return
        conn.gone = True
        if conn.reader is not None:
            conn.reader.cancel()
        if self._resumable():
            return  # the reader's end detaches the session
        self._terminate(Close(CLOSE_POLICY, "client stalled: not reading") if stalled
                        else Close(1006, "connection lost"))
        self.output.discard_events()
        if stalled:
            self.ctx.spawn(_close_stalled(conn.ws), f"{self.session_id}-stalled")


async def resume_connection(ws: web.WebSocketResponse, transport: asyncio.BaseTransport | None, ctx: ServerContext,
                            key: str | None, session_id: str) -> None:
    """Serve a connection opened with `?session_id=`: its first message must be `session.resume` for that
    session, within `config_timeout_s`. A refusal is an `error` event (outside the frame numbering) and a
    close with 1008; the session it names, if any, is untouched."""
    ctx.metrics.resumes_attempted.inc()
    try:
        request = await _first_message(ws, ctx)
        if request.session_id != session_id:
            raise ProtocolError("invalid_message", f"session.resume names session {request.session_id!r} but the "
                                f"connection was opened with ?session_id={session_id}", fatal=True,
                                param="session_id")
        runtime = ctx.resumes.claim(session_id, request.token, key)
        await runtime.resume(ws, transport, request)
    except ProtocolError as exc:
        ctx.metrics.errors.labels(exc.code).inc()
        log.info("resume of %s refused: %s", session_id, exc.code)
        with contextlib.suppress(Exception):
            await ws.send_str(encode_event(error_event(exc, fatal=True)))
            await asyncio.wait_for(ws.close(code=CLOSE_POLICY, message=exc.code.encode()), 2.0)


async def _first_message(ws: web.WebSocketResponse, ctx: ServerContext) -> SessionResume:
    try:
        async with asyncio.timeout(ctx.settings.config_timeout_s):
            msg = await ws.receive()
    except TimeoutError:
        raise ProtocolError("config_timeout", "Timeout waiting for session.resume", fatal=True) from None
    if msg.type is not WSMsgType.TEXT:
        raise ProtocolError("invalid_message", "Expected session.resume as the first message", fatal=True)
    message = decode_client_message(msg.data)
    if not isinstance(message, SessionResume):
        raise ProtocolError("invalid_message", f"Expected session.resume on a connection opened with ?session_id=, "
                            f"got: {message_type(message)}", fatal=True)
    return message


async def _close_stalled(ws: web.WebSocketResponse) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code=CLOSE_POLICY, message=b"client stalled"), 1.0)


FRAME_HEADER_MAX = 14
"""The most bytes a WebSocket frame header takes."""


def unit_request_id(session_id: str, unit: Unit) -> str:
    """The engine request id of a session's unit: `<session id>-<utterance>-<sentence>`. A function of
    the id, not a method: `UnitRuns` keeps it for the session's life, and a bound method would tie the
    session into a reference cycle that only a full garbage collection frees."""
    return f"{session_id}-{unit.utterance_index}-{unit.sentence_index}"


def _wire_size(frames: list[str | bytes]) -> int:
    """An upper bound of `frames`' payload bytes on the wire, all headers but one included (`_fits_unpaused`
    counts one): a `str` as 4 bytes a character, its most in UTF-8."""
    return (sum(len(f) if isinstance(f, bytes) else 4 * len(f) for f in frames)
            + FRAME_HEADER_MAX * (len(frames) - 1))


def _fits_unpaused(conn: Connection, size: int) -> bool:
    """Whether sending `size` more bytes (plus a frame header) on `conn` cannot wait for the client: the
    socket's write buffer is empty now, so the transport is not holding its writer paused (it resumes it
    once the buffer drains), and stays at or below its high-water mark after the frame, so it does not
    pause it; aiohttp's send then returns without waiting to drain. False when unknown. (uvloop's
    transports have these methods but are not registered as `asyncio.WriteTransport`.)"""
    transport = cast("asyncio.WriteTransport | None", conn.transport)
    if transport is None:
        return False
    try:
        return (transport.get_write_buffer_size() == 0
                and size + FRAME_HEADER_MAX <= transport.get_write_buffer_limits()[1])
    except AttributeError:
        return False


def _abort(conn: Connection) -> None:
    """Drop a connection at once (a peer that is gone or stalled would hold a graceful close)."""
    abort_transport(conn.transport)


def abort_transport(transport: asyncio.BaseTransport | None) -> None:
    """Close `transport` at once, dropping unsent bytes, on any event loop: uvloop's transports have
    `abort` but are not registered as `asyncio.Transport`, so no isinstance check (one made this a no-op
    under uvloop, the server's loop)."""
    abort = getattr(transport, "abort", None)
    if callable(abort):
        abort()


def _size(frame: str | bytes) -> int:
    return len(frame) if isinstance(frame, bytes) else len(frame.encode())


def _now_ms() -> float:
    return time.monotonic() * 1000.0
