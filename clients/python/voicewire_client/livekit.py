"""LiveKit Agents integration: `TTS`, a LiveKit `tts.TTS` plugin that speaks through a voicewire server.

Install with `pip install "voicewire-client[livekit]"`, then hand it to the agent session:

    from voicewire_client import livekit as voicewire

    session = AgentSession(stt=..., llm=..., tts=voicewire.TTS(url="ws://127.0.0.1:8000/v1/audio/speech/stream",
                                                            voice="heart"))

Contracts:
- Capabilities `streaming=True, aligned_transcript=True` (the latter only with `word_timestamps=True`).
  `stream()` takes `push_text` deltas (an LLM's tokens) and `flush()`/`end_input()`; each flushed segment
  is one voicewire utterance whose text the server cuts into sentences (`split_granularity="sentence"`,
  synthesized while the text still arrives). `synthesize(text)` speaks `text` as one utterance the same
  way. Pass `split_granularity="none"` when the text is already cut into sentences upstream (for example
  when a `tts.StreamAdapter` with a sentence tokenizer feeds `synthesize()`): it then goes through
  untouched, one synthesis unit per segment.
- Sockets come from a `ConnectionPool`: a stream or chunked request takes a configured session, and gives it
  back when its utterance ends, so one WebSocket serves segment after segment (`connections_opened` stays
  1 for a sequential agent). Concurrent requests get a socket each. A socket the server closed (its idle
  timeout, a restart) is dropped from the pool and replaced on the next request.
- Audio is pcm16 mono at `sample_rate` (the server resamples to it), pushed as it arrives.
- Timed transcripts: one `TimedString` per word, in seconds from the segment's first sample; their texts
  concatenated give the segment's text (each word carries the whitespace before it and the punctuation
  glued to it).
- Cancellation: closing a stream or chunked request before its utterance ended (barge-in) sends
  `input.cancel` for it; the socket stays open and goes back to the pool. Audio of a cancelled utterance
  is never delivered to a later request, even when it was already in flight.
- Errors raise LiveKit's `APIError` family: `APIConnectionError` (retryable) for a socket that could not
  be opened or died, `APIStatusError` for a refused token, `APIError` for a server `error` event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from livekit.agents import (
    DEFAULT_API_CONNECT_OPTIONS,
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APIStatusError,
    tts,
    utils,
)
from livekit.agents.types import TimedString

from voicewire_client._agents import Utterance, refuse_owned_fields, word_end
from voicewire_client.audio import UnitDecoder
from voicewire_client.events import (
    AudioCancelled,
    AudioData,
    AudioStart,
    AudioWords,
    ErrorEvent,
    SessionDone,
)
from voicewire_client.session import ConnectError, ServerError, Session, SessionClosedError, connect

__all__ = ["TTS", "ChunkedStream", "SynthesizeStream"]

SplitGranularity = Literal["sentence", "clause", "none"]

@dataclass(slots=True)
class _Utterance(Utterance):
    """The request's utterance on its session: its index there, its context id and the text sent so far."""

    finished: bool = False


class TTS(tts.TTS[Any]):
    """voicewire text-to-speech for LiveKit Agents (see the module doc for the contracts).

    Args:
        url: The server's stream URL (`ws://host:port/v1/audio/speech/stream`; `http(s)://host:port` works).
        token: API key, sent as `Authorization: Bearer <token>`; None for an open server.
        voice: A server voice (or an OpenAI voice name); None for the engine's default.
        model: The engine name or an alias; None for the server's engine.
        language: What the engine speaks; None for its default.
        speed: 0.25-4.0; None for 1.0.
        sample_rate: Output rate in Hz (8000-48000).
        split_granularity: How the server cuts each segment's text into synthesis units (see the module doc).
        word_timestamps: Ask for word timings and report `aligned_transcript=True`.
        session_config: Further `session.config` fields (`seed`, `instructions`, `max_buffer_delay_ms`, ...);
            the audio format fields belong to the plugin and are refused here.
    """

    def __init__(
        self,
        *,
        url: str = "ws://127.0.0.1:8000/v1/audio/speech/stream",
        token: str | None = None,
        voice: str | None = None,
        model: str | None = None,
        language: str | None = None,
        speed: float | None = None,
        sample_rate: int = 24000,
        split_granularity: SplitGranularity = "sentence",
        word_timestamps: bool = True,
        session_config: Mapping[str, Any] | None = None,
    ) -> None:
        refuse_owned_fields(session_config, "the plugin streams pcm16 in binary frames at `sample_rate`")
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=word_timestamps),
                         sample_rate=sample_rate, num_channels=1)
        self._url = url
        self._token = token
        self._model = model
        self._config: dict[str, Any] = {
            **dict(session_config or {}), "voice": voice, "model": model, "language": language, "speed": speed,
            "split_granularity": split_granularity, "word_timestamps": word_timestamps,
        }
        self._pool = utils.ConnectionPool[Session](connect_cb=self._open_session, close_cb=self._close_session)
        self.connections_opened = 0
        """How many WebSockets this TTS has opened (a sequential agent keeps one)."""

    @property
    def model(self) -> str:
        return self._model or "voicewire"

    @property
    def provider(self) -> str:
        return "voicewire"

    def session_config(self) -> dict[str, Any]:
        """The `session.config` fields each pooled session is configured with (None values left out)."""
        fields = {**self._config, "response_format": "pcm", "sample_rate": self.sample_rate,
                  "stream_audio": True, "audio_frames": "binary"}
        return {k: v for k, v in fields.items() if v is not None}

    def update_options(self, *, voice: str | None = None, speed: float | None = None,
                       language: str | None = None) -> None:
        """Change the voice, speed or language of requests made from now on (requests in flight keep theirs;
        pooled sockets are replaced)."""
        for key, value in (("voice", voice), ("speed", speed), ("language", language)):
            if value is not None:
                self._config[key] = value
        self._pool.invalidate()

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
                   ) -> ChunkedStream:
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        return SynthesizeStream(tts=self, conn_options=conn_options)

    def prewarm(self) -> None:
        """Open and configure a pooled socket in the background."""
        self._pool.prewarm()

    async def aclose(self) -> None:
        """Close every pooled socket."""
        await self._pool.aclose()

    # -- the session pool ----------------------------------------------------------------------------

    async def _open_session(self, connect_timeout: float) -> Session:
        try:
            session: Session = await connect(self._url, token=self._token, open_timeout=connect_timeout)
        except ConnectError as exc:
            if "rejected the token" in str(exc):
                raise APIStatusError(str(exc), status_code=401, retryable=False) from None
            raise APIConnectionError(str(exc)) from None
        try:
            await asyncio.wait_for(session.configure(**self.session_config()), connect_timeout)
        except ServerError as exc:
            await session.close()
            raise APIError(f"voicewire refused the session config: {exc}", retryable=False) from None
        except (SessionClosedError, TimeoutError) as exc:
            await session.close()
            raise APIConnectionError(f"voicewire did not configure the session: {exc}") from None
        self.connections_opened += 1
        return session

    @staticmethod
    async def _close_session(session: Session) -> None:
        await session.close()

    async def _acquire(self, connect_timeout: float) -> Session:
        """A pooled session whose socket is still open."""
        while True:
            session: Session = await self._pool.get(timeout=connect_timeout)
            if session.close_code is None:
                return session
            self._pool.remove(session)

    async def _release(self, session: Session, utterances: list[_Utterance]) -> None:
        """Give the session back: unfinished utterances are cancelled first; a dead socket is dropped."""
        if any(not u.finished for u in utterances) and session.close_code is None:
            with contextlib.suppress(SessionClosedError):
                await session.cancel()
        if session.close_code is None:
            self._pool.put(session)
        else:
            self._pool.remove(session)


class ChunkedStream(tts.ChunkedStream):
    """`TTS.synthesize()`: the whole text as one utterance; audio and timed words as they arrive."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=self._tts.sample_rate,
                                  num_channels=1, mime_type="audio/pcm")
        session = await self._tts._acquire(self._conn_options.timeout)
        utterance = _Utterance(session.current_utterance_index, utils.shortuuid())
        try:
            utterance.parts.append(self._input_text)
            await _send(session.send_text(self._input_text, context_id=utterance.context_id))
            await _send(session.done(context_id=utterance.context_id))
            await _speak(session, utterance, output_emitter)
            output_emitter.flush()
        finally:
            await self._tts._release(session, [utterance])


class SynthesizeStream(tts.SynthesizeStream):
    """`TTS.stream()`: each segment (text up to a `flush()`) is one utterance on one pooled socket."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=self._tts.sample_rate,
                                  num_channels=1, mime_type="audio/pcm", stream=True)
        session = await self._tts._acquire(self._conn_options.timeout)
        segments: asyncio.Queue[_Utterance | None] = asyncio.Queue()
        started: list[_Utterance] = []
        current: _Utterance | None = None

        async def send_segments() -> None:
            nonlocal current
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if current is not None:
                        await _send(session.done(context_id=current.context_id))
                        current = None
                    continue
                if current is None:
                    current = _Utterance(session.current_utterance_index, utils.shortuuid())
                    started.append(current)
                    segments.put_nowait(current)
                    self._mark_started()
                current.parts.append(data)
                await _send(session.send_text(data, context_id=current.context_id))
            segments.put_nowait(None)

        async def speak_segments() -> None:
            while (utterance := await segments.get()) is not None:
                output_emitter.start_segment(segment_id=utterance.context_id)
                await _speak(session, utterance, output_emitter)
                output_emitter.end_segment()

        tasks = [asyncio.create_task(send_segments(), name="voicewire-livekit-send"),
                 asyncio.create_task(speak_segments(), name="voicewire-livekit-speak")]
        try:
            await asyncio.gather(*tasks)
        finally:
            await utils.aio.gracefully_cancel(*tasks)
            await self._tts._release(session, started)


async def _send(message: Any) -> None:
    """Await one client send, turning a closed socket into LiveKit's retryable connection error."""
    try:
        await message
    except SessionClosedError as exc:
        raise APIConnectionError(f"the voicewire socket closed: {exc}") from None


async def _speak(session: Session, utterance: _Utterance, emitter: tts.AudioEmitter) -> None:
    """Push `utterance`'s audio and timed words to `emitter` until its `session.done`. Events of earlier
    utterances of the session (what a cancelled request left in flight) are skipped."""
    decoder: UnitDecoder | None = None
    cursor = 0
    async for event in session:
        index = getattr(event, "utterance_index", None)
        if isinstance(event, ErrorEvent):
            if event.fatal or index is None or index >= utterance.index:
                raise APIError(f"voicewire error {event.code}: {event.message}",
                               retryable=event.fatal or event.code == "generation_failed")
            continue
        if index != utterance.index:
            continue
        if isinstance(event, AudioStart):
            decoder = UnitDecoder(event.format)
        elif isinstance(event, AudioData) and decoder is not None:
            emitter.push(decoder.feed(event.data).astype("<i2", copy=False).tobytes())
        elif isinstance(event, AudioWords):
            text = utterance.text()
            for word in event.words:
                end = word_end(text, word)
                if end > cursor:
                    emitter.push_timed_transcript(TimedString(text[cursor:end], start_time=word.start_ms / 1000,
                                                              end_time=word.end_ms / 1000))
                    cursor = end
        elif isinstance(event, SessionDone | AudioCancelled):
            utterance.finished = True
            return
    raise APIConnectionError(f"the voicewire socket closed mid-utterance (code {session.close_code})")
