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
- Iteration ends when the socket closes; `close_code` / `close_reason` then say why.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import websockets
from websockets.asyncio.client import ClientConnection

from voicewire_client.events import (
    AudioData,
    AudioDone,
    AudioStart,
    AudioWords,
    ErrorEvent,
    Event,
    SessionUpdated,
    WordTiming,
    parse_event,
)

STREAM_PATH: Final = "/v1/audio/speech/stream"

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

    def __init__(self, ws: ClientConnection, *, max_queued: int = 1024) -> None:
        self._ws = ws
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
        """Send `session.close` and close the socket (idempotent)."""
        if self._closed is None:
            with contextlib.suppress(SessionClosedError):
                await self._send({"type": "session.close"})
        await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    @property
    def current_utterance_index(self) -> int:
        """The `utterance_index` the server gives the text of the next `send_text()` (or the next `done()`):
        the open utterance's, or the next one's when none is open."""
        return self._utterances_opened - 1 if self._utterance_open else self._utterances_opened

    @property
    def close_code(self) -> int | None:
        return None if self._closed is None else self._closed.code

    @property
    def close_reason(self) -> str:
        return "" if self._closed is None else self._closed.reason

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            await self._ws.send(json.dumps(message))
        except websockets.ConnectionClosed as exc:
            received = exc.rcvd
            raise SessionClosedError(received.code if received else None,
                                     received.reason if received else "") from None

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
            async for frame in self._ws:
                for event in self._events_of(frame):
                    if not self._answers_configure(event):
                        await self._enqueue(event)
        except websockets.ConnectionClosed:
            pass
        finally:
            self._closed = _Closed(self._ws.close_code, self._ws.close_reason or "")
            if self._configuring is not None and not self._configuring.done():
                self._configuring.set_exception(SessionClosedError(self._closed.code, self._closed.reason))
            self._arrived.set()

    def _events_of(self, frame: str | bytes) -> list[Event]:
        if isinstance(frame, bytes):
            unit = self._unit
            if unit is None or unit.utterance_index < self._drop_before:
                return []
            return [AudioData(unit.utterance_index, unit.sentence_index, frame)]
        data = json.loads(frame)
        if data.get("type") == "audio.chunk":
            return self._chunk_events(data)
        event = parse_event(data)
        if isinstance(event, AudioStart):
            self._unit = event
        elif isinstance(event, AudioDone):
            self._unit = None
            offset = self._unit_offset_ms.get(event.utterance_index, 0.0)
            self._unit_offset_ms[event.utterance_index] = offset + event.audio_ms
        return [event]

    def _chunk_events(self, data: dict[str, Any]) -> list[Event]:
        """vllm-omni's JSON audio frame: its audio as `AudioData`, its unit-relative timestamps as
        `AudioWords` on the utterance timeline."""
        utterance, sentence = int(data["utterance_index"]), int(data["sentence_index"])
        events: list[Event] = []
        audio = base64.b64decode(data.get("audio_b64") or "")
        if audio and utterance >= self._drop_before:
            events.append(AudioData(utterance, sentence, audio))
        if data.get("timestamps"):
            offset = self._unit_offset_ms.get(utterance, 0.0)
            words = tuple(WordTiming.from_json(w) for w in data["timestamps"])
            events.append(AudioWords(utterance, sentence, tuple(
                WordTiming(w.word, w.start_ms + offset, w.end_ms + offset, w.char_start, w.char_end) for w in words)))
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
                 max_queued: int = 1024) -> None:
        self.url = stream_url(url)
        self.token = token
        self.open_timeout = open_timeout
        self.max_queued = max_queued
        self._session: Session | None = None

    async def _open(self) -> Session:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            ws = await websockets.connect(self.url, additional_headers=headers, open_timeout=self.open_timeout,
                                          max_size=None)
        except websockets.InvalidStatus as exc:
            raise ConnectError(_status_message(self.url, exc.response.status_code)) from None
        except (OSError, TimeoutError) as exc:
            raise ConnectError(f"could not connect to {self.url}: {_os_reason(exc)}; is the voicewire server "
                               "running there?") from None
        except websockets.InvalidHandshake as exc:
            raise ConnectError(f"could not open a WebSocket at {self.url}: {exc}") from None
        return Session(ws, max_queued=self.max_queued)

    def __await__(self) -> Any:
        return self._open().__await__()

    async def __aenter__(self) -> Session:
        self._session = await self._open()
        return self._session

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()


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


def _context(context_id: str | None) -> dict[str, str]:
    return {} if context_id is None else {"context_id": context_id}
