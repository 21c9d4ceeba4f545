"""The asyncio session: one WebSocket to `/v1/audio/speech/stream`, typed events in, messages out.

    async with connect("ws://127.0.0.1:8000/v1/audio/speech/stream", token=key) as session:
        await session.configure(voice="heart", response_format="pcm", stream_audio=True)
        await session.send_text("Hello there. ")
        await session.done()
        async for event in session:
            ...

Contracts:
- One reader task turns every frame into an `Event` as it arrives and queues it (at most `max_queued`
  events; past that it stops reading, so a caller that stops iterating applies backpressure to the
  server instead of growing memory).
- `configure()` waits for its answer; that `session.updated` (or `error`) is returned (or raised), not
  queued. Call it before the first utterance and between utterances, never while iterating elsewhere.
- After `cancel()` returns, iteration yields no `AudioData` of the cancelled utterances, even frames the
  server sent before it saw the cancel; `AudioCancelled` follows when an utterance was in progress.
- Resume: the session acknowledges what it receives (`session.ack`) and numbers what it sends. When the
  connection drops without a close frame (a network blip), it reconnects by itself with backoff (for up to
  the server's `resume_window_s`), sends `session.resume`, and carries on: the server replays exactly the
  frames that were lost, in order, and this session resends the messages the server had not applied.
  Iteration goes on as if nothing happened: no frame is yielded twice or skipped. `reconnects` counts the
  resumes; `resume=False` in `connect()` turns all of it off (a dropped connection then ends the session).
- `close()` ends the session on the server also when the connection has dropped (a resume under way, or a
  drop not noticed yet): the session resumes only to deliver `session.close` (trying for up to
  `CLOSE_RESUME_S`; what the server still sends then is discarded), so the server does not keep it for
  the rest of its resume window.
- Iteration ends when the session closes; `close_code` / `close_reason` then say why.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final
from urllib.parse import urlencode, urlsplit, urlunsplit

import msgspec
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.frames import Close

from voicewire_client.events import (
    AudioChunk,
    AudioData,
    AudioDone,
    AudioStart,
    AudioWords,
    ErrorEvent,
    Event,
    SessionUpdated,
    decode_event,
    parse_event,
)

STREAM_PATH: Final = "/v1/audio/speech/stream"
ACK_EVERY_BYTES: Final = 64 * 1024
"""Binary audio received between two `session.ack`s at most (acks also follow every JSON event); less on a
server whose `replay_buffer_bytes` is small: a quarter of it (the server stops sending once that much is
unacknowledged, so acking less often would stall the session)."""
RECONNECT_FIRST_DELAY_S: Final = 0.05
RECONNECT_MAX_DELAY_S: Final = 2.0
CLOSE_RESUME_S: Final = 10.0
"""How long `close()` goes on trying to resume a dropped connection to deliver `session.close` (past it the
server ends the session when its resume window passes)."""


class _Stamp(msgspec.Struct):
    """The numbers a resuming server appends to every event: `input_seq` counts the client messages it
    applied (None from a server without resume)."""

    input_seq: int | None = None


_stamp_decoder: Final = msgspec.json.Decoder(_Stamp)

STREAMING_DEFAULTS: Final[dict[str, Any]] = {
    "response_format": "pcm",
    "stream_audio": True,
    "split_granularity": "sentence",
    "audio_frames": "binary",
}
"""What `configure()` sends unless told otherwise: pcm16 streamed in binary frames and a unit per sentence
(pipelined while text arrives); add `word_timestamps=True` for `AudioWords`. The server's own defaults are
vllm-omni's (one whole WAV per utterance); pass `split_granularity="none", response_format="wav", ...` to
get those."""


class VoicewireError(Exception):
    """Base class of every error this client raises."""


class ConnectError(VoicewireError):
    """The WebSocket could not be opened: unreachable server, refused token, bad URL, not ready."""


class ServerError(VoicewireError):
    """The server sent an `error` event; `event` holds its code, message and whether it was fatal."""

    def __init__(self, event: ErrorEvent) -> None:
        super().__init__(f"server error {event.code}: {event.message}")
        self.event = event


class SessionClosedError(VoicewireError):
    """The socket closed before the awaited answer arrived."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"the server closed the session (code {code}{': ' + reason if reason else ''})")
        self.code = code
        self.reason = reason


def stream_url(url: str) -> str:
    """Accept `ws(s)://host:port[/path]` or `http(s)://host:port[/path]`; an empty path means the
    speech stream route."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise ConnectError(f"invalid server URL {url!r}: expected ws://host:port{STREAM_PATH}")
    path = parts.path if parts.path not in ("", "/") else STREAM_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


@dataclass(frozen=True, slots=True)
class _Closed:
    code: int | None
    reason: str


class Session:
    """An open voicewire session. Get one from `connect()`; see the module doc for the contracts."""

    def __init__(self, ws: ClientConnection, *, max_queued: int = 1024,
                 redial: Callable[[str], Awaitable[ClientConnection]] | None = None) -> None:
        self._ws = ws
        self._redial = redial
        """Opens a new connection with the given `session_id` query parameter, or raises `ConnectError` (the
        resume retries with backoff); None: never resume."""
        self._seq = 0
        """Server frames received (the number of the last one)."""
        self._acked_bytes = 0
        self._ack_every = ACK_EVERY_BYTES
        """Binary bytes between two acks (`ACK_EVERY_BYTES`, or less for the server's replay buffer)."""
        self._sent_count = 0
        """Client messages sent (numbered as the server counts them)."""
        self._unapplied: deque[tuple[int, str]] = deque()
        """Messages sent that the server has not said it applied, to resend after a resume."""
        self._session_id: str | None = None
        self._token: str | None = None
        self._window_s = 0.0
        self._user_closed = False
        self._close_by = 0.0
        """When `close()` stops trying to deliver `session.close` over a resume (loop time)."""
        self._send_lock = asyncio.Lock()
        self.reconnects = 0
        """Times this session resumed on a new connection."""
        self._events: deque[Event] = deque()
        self._max_queued = max_queued
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._configuring: asyncio.Future[SessionUpdated] | None = None
        self._unit: AudioStart | None = None
        self._unit_offset_ms: dict[int, float] = {}
        self._utterances_opened = 0
        self._utterance_open = False
        self._drop_before = 0
        self._closed: _Closed | None = None
        self.updated: SessionUpdated | None = None
        """The answer to the last accepted `configure()`."""
        self._reader = asyncio.create_task(self._read_loop(), name="voicewire-client-reader")

    # -- messages out ------------------------------------------------------------------------------

    async def configure(self, **config: Any) -> SessionUpdated:
        """Send `session.config` (`STREAMING_DEFAULTS` overridden by `config`; `None` values dropped) and
        return the server's `session.updated`. Raises `ServerError` when the server refuses it (the old
        config stays in force; before the first accepted config a refusal is fatal and the server closes
        the socket), `SessionClosedError` when the socket closes first."""
        fields = {k: v for k, v in {**STREAMING_DEFAULTS, **config}.items() if v is not None}
        answer: asyncio.Future[SessionUpdated] = asyncio.get_running_loop().create_future()
        self._configuring = answer
        try:
            await self._send({"type": "session.config", **fields})
            self.updated = await answer
            return self.updated
        finally:
            self._configuring = None
            if answer.done() and not answer.cancelled():
                answer.exception()  # retrieved: a close racing a failed send must not log a stray error

    async def send_text(self, text: str, *, context_id: str | None = None) -> None:
        """Append a text delta (any size: a token, a word, a sentence); opens an utterance if none is."""
        if not self._utterance_open:
            self._utterance_open = True
            self._utterances_opened += 1
        await self._send({"type": "input.text", "text": text, **_context(context_id)})

    async def done(self, *, context_id: str | None = None) -> None:
        """End the utterance: the rest is synthesized, then `SessionDone` arrives."""
        if not self._utterance_open:
            self._utterances_opened += 1
        self._utterance_open = False
        await self._send({"type": "input.done", **_context(context_id)})

    async def cancel(self, *, context_id: str | None = None) -> None:
        """Barge-in: stop every utterance in progress now. From this call on no `AudioData` of them is
        yielded. (With `context_id`, the server stops only that context's utterances, and this client
        still drops the audio of all of them: use one session per context to keep others.)"""
        self._drop_before = self._utterances_opened
        self._utterance_open = False
        await self._send({"type": "input.cancel", **_context(context_id)})

    async def close(self) -> None:
        """Send `session.close` and close the socket (idempotent). When the connection has dropped, this
        returns once a resume delivered `session.close` (the server then ends the session), the server
        refused the resume (the session is over already), or `CLOSE_RESUME_S` passed."""
        if not self._user_closed:
            self._user_closed = True
            self._close_by = asyncio.get_running_loop().time() + CLOSE_RESUME_S
            if self._closed is None:
                with contextlib.suppress(SessionClosedError):
                    await self._send({"type": "session.close"})  # kept for the resume when the connection is down
        await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    @property
    def current_utterance_index(self) -> int:
        """The `utterance_index` the server gives the text of the next `send_text()` (or the next `done()`):
        the open utterance's, or the next one's when none is open."""
        return self._utterances_opened - 1 if self._utterance_open else self._utterances_opened

    @property
    def closed(self) -> bool:
        """The session is over (iteration has ended or is ending); false while a dropped connection is being
        resumed."""
        return self._closed is not None

    @property
    def close_code(self) -> int | None:
        return None if self._closed is None else self._closed.code

    @property
    def close_reason(self) -> str:
        return "" if self._closed is None else self._closed.reason

    async def _send(self, message: dict[str, Any]) -> None:
        """Send a numbered message. While the connection is being resumed it is only kept: the resume sends
        it. Raises `SessionClosedError` once the session is closed for good."""
        if self._closed is not None:
            raise SessionClosedError(self._closed.code, self._closed.reason)
        text = json.dumps(message)
        async with self._send_lock:  # numbered in the order sent, never between a resume and its resends
            self._sent_count += 1
            if self._redial is not None:
                self._unapplied.append((self._sent_count, text))
            try:
                await self._ws.send(text)
            except websockets.ConnectionClosed as exc:
                if self._redial is not None and self._session_id is not None and not _closed_on_purpose(exc.rcvd):
                    return  # the reader resumes and resends it
                received = exc.rcvd
                raise SessionClosedError(received.code if received else None,
                                         received.reason if received else "") from None

    async def _send_control(self, message: dict[str, Any]) -> None:
        """An unnumbered message (`session.ack`); lost with the connection, which is harmless."""
        with contextlib.suppress(websockets.ConnectionClosed):
            async with self._send_lock:
                await self._ws.send(json.dumps(message))

    # -- events in ---------------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while True:
            item = await self._next_queued()
            if isinstance(item, AudioData) and item.utterance_index < self._drop_before:
                continue
            return item

    async def _next_queued(self) -> Event:
        """Cancellation-safe: an event leaves the queue only in the same step as it is returned."""
        while not self._events:
            if self._closed is not None:
                raise StopAsyncIteration
            self._arrived.clear()
            await self._arrived.wait()
        self._room.set()
        return self._events.popleft()

    async def _enqueue(self, event: Event) -> None:
        while len(self._events) >= self._max_queued:
            self._room.clear()
            await self._room.wait()
        self._events.append(event)
        self._arrived.set()

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    async for frame in self._ws:
                        self._seq += 1
                        for event in self._events_of(frame):
                            if not self._answers_configure(event):
                                await self._enqueue(event)
                        await self._acknowledge(frame)
                except websockets.ConnectionClosed:
                    pass
                if not await self._resume():
                    return
        finally:
            self._closed = _Closed(self._ws.close_code, self._ws.close_reason or "")
            if self._configuring is not None and not self._configuring.done():
                self._configuring.set_exception(SessionClosedError(self._closed.code, self._closed.reason))
            self._arrived.set()

    async def _acknowledge(self, frame: str | bytes) -> None:
        if self._redial is None or self._session_id is None:
            return
        if isinstance(frame, bytes):
            self._acked_bytes += len(frame)
            if self._acked_bytes < self._ack_every:
                return
        self._acked_bytes = 0
        await self._send_control({"type": "session.ack", "seq": self._seq})

    async def _resume(self) -> bool:
        """After a drop without a close frame: reconnect with backoff and resume, for up to the server's
        resume window. True when the stream goes on (on `self._ws`), False when the session is over (the
        server closed it, refused the resume, or the window passed). Once `close()` was called the resume
        only delivers `session.close` (`_deliver_close`), and gives up at `_close_by`."""
        if (self._redial is None or self._session_id is None or self._token is None
                or _closed_on_purpose(self._ws.protocol.close_rcvd)):
            return False
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._window_s

        def time_left() -> float:
            return min(give_up, self._close_by if self._user_closed else give_up) - loop.time()

        delay = RECONNECT_FIRST_DELAY_S
        while time_left() > 0:
            try:
                ws = await self._redial(self._session_id)
            except ConnectError:
                await asyncio.sleep(max(0.0, min(delay, time_left())))
                delay = min(delay * 2, RECONNECT_MAX_DELAY_S)
                continue
            try:
                await ws.send(json.dumps({"type": "session.resume", "session_id": self._session_id,
                                          "token": self._token, "seq": self._seq}))
                answer = json.loads(await ws.recv())
            except websockets.ConnectionClosed:
                continue
            if answer.get("type") != "session.resumed":
                self._ws = ws
                if not self._user_closed:  # after close() a refusal means the session is over, as asked
                    await self._enqueue(parse_event(answer))  # the refusal says why
                await ws.close()
                return False
            async with self._send_lock:
                self._ws = ws
                self._applied(int(answer["input_seq"]))
                try:
                    for _number, text in self._unapplied:
                        await ws.send(text)
                except websockets.ConnectionClosed:
                    pass
            self.reconnects += 1
            if self._user_closed:
                await self._deliver_close(ws)
                return False
            return True
        return False

    async def _deliver_close(self, ws: ClientConnection) -> None:
        """`close()` came while the connection was down, and `ws` resumed the session: `session.close` went
        out with the resent messages (or, when `close()` was waiting for the send lock, it goes out on `ws`
        now). Discard what the server still sends until it closes the connection, which ends the session."""
        with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
            async with asyncio.timeout(max(0.0, self._close_by - asyncio.get_running_loop().time())):
                async for _frame in ws:
                    pass
        await ws.close()

    def _applied(self, input_seq: int) -> None:
        """The server applied the first `input_seq` messages: forget them."""
        unapplied = self._unapplied
        while unapplied and unapplied[0][0] <= input_seq:
            unapplied.popleft()

    def _events_of(self, frame: str | bytes) -> list[Event]:
        if isinstance(frame, bytes):
            unit = self._unit
            if unit is None or unit.utterance_index < self._drop_before:
                return []
            return [AudioData(unit.utterance_index, unit.sentence_index, frame)]
        event = decode_event(frame)
        stamp = _stamp_decoder.decode(frame)
        if stamp.input_seq is not None:
            self._applied(stamp.input_seq)
        if isinstance(event, AudioChunk):
            return self._chunk_events(event)
        if isinstance(event, SessionUpdated):
            self._session_id = event.session_id
            self._token = event.resume_token
            self._window_s = float(event.limits.get("resume_window_s", 0.0))
            replay_bytes = int(event.limits.get("replay_buffer_bytes", 0))
            self._ack_every = min(ACK_EVERY_BYTES, replay_bytes // 4) if replay_bytes > 0 else ACK_EVERY_BYTES
        if isinstance(event, AudioStart):
            self._unit = event
        elif isinstance(event, AudioDone):
            self._unit = None
            offset = self._unit_offset_ms.get(event.utterance_index, 0.0)
            self._unit_offset_ms[event.utterance_index] = offset + event.audio_ms
        return [event]

    def _chunk_events(self, chunk: AudioChunk) -> list[Event]:
        """vllm-omni's JSON audio frame: its audio as `AudioData`, its unit-relative timestamps as
        `AudioWords` on the utterance timeline."""
        utterance, sentence = chunk.utterance_index, chunk.sentence_index
        events: list[Event] = []
        audio = base64.b64decode(chunk.audio_b64)
        if audio and utterance >= self._drop_before:
            events.append(AudioData(utterance, sentence, audio))
        if chunk.timestamps:
            offset = self._unit_offset_ms.get(utterance, 0.0)
            events.append(AudioWords(utterance, sentence, tuple(
                msgspec.structs.replace(w, start_ms=w.start_ms + offset, end_ms=w.end_ms + offset)
                for w in chunk.timestamps)))
        return events

    def _answers_configure(self, event: Event) -> bool:
        waiter = self._configuring
        if waiter is None or waiter.done():
            return False
        if isinstance(event, SessionUpdated):
            waiter.set_result(event)
            return True
        if isinstance(event, ErrorEvent) and event.utterance_index is None:
            waiter.set_exception(ServerError(event))
            return True
        return False


class connect:
    """Open a session: `async with connect(url, token=...) as session:` (or `session = await connect(...)`
    and `await session.close()`).

    `token` is sent as `Authorization: Bearer <token>`. Raises `ConnectError` with a message that says
    what to fix: server unreachable, token refused (HTTP 401/403), server not ready (503), bad URL.
    """

    def __init__(self, url: str, *, token: str | None = None, open_timeout: float = 10.0,
                 max_queued: int = 1024, resume: bool = True) -> None:
        self.url = stream_url(url)
        self.token = token
        self.open_timeout = open_timeout
        self.max_queued = max_queued
        self.resume = resume
        self._session: Session | None = None

    async def _open(self) -> Session:
        ws = await self._dial(self.url)
        return Session(ws, max_queued=self.max_queued, redial=self._redial if self.resume else None)

    async def _redial(self, session_id: str) -> ClientConnection:
        return await self._dial(resume_url(self.url, session_id))

    async def _dial(self, url: str) -> ClientConnection:
        return await dial(url, token=self.token, open_timeout=self.open_timeout, shown_url=self.url)

    def __await__(self) -> Any:
        return self._open().__await__()

    async def __aenter__(self) -> Session:
        self._session = await self._open()
        return self._session

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()


def resume_url(url: str, session_id: str) -> str:
    """The URL of a connection that resumes `session_id`: `url` plus `?session_id=` (the query parameter
    routes it through balancers to the server that holds the session)."""
    parts = urlsplit(url)
    query = "&".join(q for q in (parts.query, urlencode({"session_id": session_id})) if q)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))


async def dial(url: str, *, token: str | None, open_timeout: float, shown_url: str | None = None,
               opener: Callable[..., Awaitable[ClientConnection]] = websockets.connect) -> ClientConnection:
    """Open a WebSocket to `url` with `opener` (`websockets.connect` or a wrapper taking its arguments),
    `token` as `Authorization: Bearer`. Raises `ConnectError` with a message naming `shown_url` (default
    `url`) that says what to fix: server unreachable, token refused (HTTP 401/403), not ready (503), bad
    URL."""
    shown = shown_url or url
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return await opener(url, additional_headers=headers, open_timeout=open_timeout, max_size=None)
    except websockets.InvalidStatus as exc:
        raise ConnectError(_status_message(shown, exc.response.status_code)) from None
    except (OSError, TimeoutError) as exc:
        raise ConnectError(f"could not connect to {shown}: {_os_reason(exc)}; is the voicewire server "
                           "running there?") from None
    except websockets.InvalidHandshake as exc:
        raise ConnectError(f"could not open a WebSocket at {shown}: {exc}") from None


def _status_message(url: str, status: int) -> str:
    if status in (401, 403):
        return (f"the server at {url} rejected the token (HTTP {status}): check --token or VOICEWIRE_TOKEN")
    if status == 503:
        return f"the server at {url} is not ready (HTTP 503): its engine is still loading or it is shutting down"
    if status == 404:
        return f"no voicewire stream at {url} (HTTP 404): check the URL path ({STREAM_PATH})"
    return f"the server at {url} refused the WebSocket upgrade (HTTP {status})"


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def _closed_on_purpose(received: Close | None) -> bool:
    """The server sent a close frame: the session ended (a dropped network sends none)."""
    return received is not None


def _context(context_id: str | None) -> dict[str, str]:
    return {} if context_id is None else {"context_id": context_id}
