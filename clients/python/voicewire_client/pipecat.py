"""Pipecat integration: `VoicewireTTSService`, a Pipecat TTS service on one persistent voicewire WebSocket.

Install with `pip install "voicewire-client[pipecat]"`, then put the service where any Pipecat TTS goes:

    from voicewire_client.pipecat import VoicewireTTSService

    tts = VoicewireTTSService(url="ws://127.0.0.1:8000/v1/audio/speech/stream", voice="heart")
    pipeline = Pipeline([transport.input(), stt, user_aggregator, llm, tts, transport.output(),
                         assistant_aggregator])

Contracts:
- One voicewire session per service, opened at `StartFrame` and closed at `EndFrame`/`CancelFrame`.
  A connection that drops without a close frame (a network blip) is resumed by the client's `Session`:
  it reconnects to the same URL plus `?session_id=` within the server's `resume_window_s`, the server
  replays what was lost and the session resends the text the server had not applied, so the turn in
  progress plays on with no sample lost or repeated (text sent meanwhile is kept and goes out on the
  resumed connection). The session is replaced only when it actually ends (the server closed it, or the
  resume was refused or ran out of time): then Pipecat's reconnect loop opens a new one with exponential
  backoff (`reconnect_backoff_min_wait` .. `reconnect_backoff_max_wait` seconds); audio still due on the
  ended session is lost and the turn in progress moves to a new audio context.
- A Pipecat audio context is a voicewire `context_id`: every `input.text`/`input.done` of the context
  carries it. With `TextAggregationMode.TOKEN` the LLM's tokens of a context form one utterance that the
  server splits into sentences (`split_granularity: "sentence"`), ended by `input.done` when Pipecat flushes
  the context. With `TextAggregationMode.SENTENCE` (Pipecat's default) Pipecat has already cut the text
  into sentences, so each sentence goes through untouched as one utterance of its context
  (`split_granularity: "none"`, `input.text` then `input.done`); the server still synthesizes the next
  sentence while the current one streams.
- Word timestamps reach Pipecat through `add_word_timestamps`, in seconds on one timeline per audio context
  (0 = the context's first sample), cumulative across the context's utterances. The reported word is the
  text that was sent for it, trailing punctuation included.
- Interruption (`InterruptionFrame`) sends `input.cancel` for each interrupted context; the socket stays
  open and the next turn uses it. Audio of a cancelled context that was already in flight is dropped.
- The audio is pcm16 mono at the pipeline's output rate (`audio_out_sample_rate`, or `sample_rate` when
  given): the service asks the server for that rate in `session.config`, so nothing is resampled here.
- Changing `voice`, `model` or `language` with `TTSUpdateSettingsFrame` re-sends `session.config` before
  the next utterance (the server refuses a config while an utterance is open, so it is never sent then).
- The socket is a `voicewire_client.Session` on Pipecat's bounded connection: the handshake
  (`session.config` answered by `session.updated`), the messages sent, the decoding of events and the
  resume are the client's, shared with `connect()`; this module only maps them onto Pipecat's frames and
  contexts.
- Memory: the service keeps, per open context, the text of its utterances in flight (for word spans) and
  a few counters; audio is handed to Pipecat as it arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, StartFrame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
from pipecat.transcriptions.language import Language
from websockets.asyncio.client import ClientConnection

from voicewire_client._agents import Utterance, refuse_owned_fields, word_end
from voicewire_client.audio import UnitDecoder
from voicewire_client.events import (
    AudioCancelled,
    AudioData,
    AudioStart,
    AudioWords,
    ErrorEvent,
    Event,
    SessionDone,
    WordTiming,
)
from voicewire_client.session import (
    ConnectError,
    ServerError,
    Session,
    SessionClosedError,
    dial,
    resume_url,
    stream_url,
)

__all__ = ["VoicewireTTSService"]

@dataclass(slots=True)
class _Utterance(Utterance):
    """One voicewire utterance of an audio context, from its first `input.text` to its `session.done`."""

    base_bytes: int | None = None
    """Audio bytes of the context before this utterance's first sample (set at its first `audio.start`)."""


@dataclass(slots=True)
class _Context:
    """A Pipecat audio context on the server: its utterances still in flight and its audio so far."""

    context_id: str
    open: _Utterance | None = None
    pending: set[int] = field(default_factory=set)
    flushed: bool = False
    audio_bytes: int = 0


def spoken_word(text: str, word: WordTiming) -> str:
    """The word as it was sent: `text[char_start:char_end]` plus the punctuation glued to its end."""
    return text[word.char_start:word_end(text, word)] or word.word


class VoicewireTTSService(WebsocketTTSService):
    """Pipecat text-to-speech on a voicewire server (see the module doc for the contracts).

    Args:
        url: The server's stream URL (`ws://host:port/v1/audio/speech/stream`; `http(s)://host:port` works).
        token: API key, sent as `Authorization: Bearer <token>`; None for an open server.
        voice: A server voice (or an OpenAI voice name); None for the engine's default.
        model: The engine name or an alias; None for the server's engine.
        language: What the engine speaks; None for its default.
        speed: 0.25-4.0; None for 1.0.
        sample_rate: Output rate; None for the pipeline's `audio_out_sample_rate`.
        text_aggregation_mode: `SENTENCE` (default): Pipecat cuts sentences and each one is spoken as sent;
            `TOKEN`: tokens stream to the server, which cuts sentences itself (lower latency).
        session_config: Further `session.config` fields (`seed`, `instructions`, `max_buffer_delay_ms`,
            `split_granularity`, ...). The audio format fields belong to the service and are refused here.
        config_timeout: Seconds to wait for the server's answer to `session.config` when connecting.
        **kwargs: Passed to `WebsocketTTSService` (e.g. `reconnect_backoff_min_wait`, `text_transforms`).
    """

    def __init__(
        self,
        *,
        url: str,
        token: str | None = None,
        voice: str | None = None,
        model: str | None = None,
        language: Language | str | None = None,
        speed: float | None = None,
        sample_rate: int | None = None,
        text_aggregation_mode: TextAggregationMode | None = None,
        session_config: Mapping[str, Any] | None = None,
        config_timeout: float = 10.0,
        reconnect_backoff_min_wait: float = 1.0,
        reconnect_backoff_max_wait: float = 10.0,
        **kwargs: Any,
    ) -> None:
        refuse_owned_fields(session_config, "the service streams pcm16 in binary frames with word timestamps at "
                                            "the pipeline's sample rate")
        super().__init__(
            text_aggregation_mode=text_aggregation_mode,
            push_text_frames=False,
            push_start_frame=True,
            sample_rate=sample_rate,
            settings=TTSSettings(model=model, voice=voice, language=language),
            reconnect_backoff_min_wait=reconnect_backoff_min_wait,
            reconnect_backoff_max_wait=reconnect_backoff_max_wait,
            **kwargs,
        )
        self._url = stream_url(url)
        self._token = token
        self._speed = speed
        self._extra_config = dict(session_config or {})
        self._config_timeout = config_timeout
        self._receive_task: asyncio.Task[None] | None = None
        self._session: Session | None = None
        self._config_dirty = False
        self._contexts: dict[str, _Context] = {}
        self._utterances: dict[int, _Utterance] = {}
        self._unit: tuple[_Utterance | None, UnitDecoder] | None = None

    # -- public surface ------------------------------------------------------------------------------

    @property
    def session_id(self) -> str | None:
        """The server's `session_id` of the current WebSocket; None while disconnected."""
        updated = self._session.updated if self._session is not None else None
        return updated.session_id if updated is not None else None

    def can_generate_metrics(self) -> bool:
        """TTFB, TTFA and usage metrics are reported."""
        return True

    def session_config(self) -> dict[str, Any]:
        """The `session.config` message this service sends (None values left out)."""
        return {"type": "session.config", **self._config_fields()}

    def _config_fields(self) -> dict[str, Any]:
        language = self._settings.language
        fields: dict[str, Any] = {
            "split_granularity": "sentence" if self._is_streaming_tokens else "none",
            **self._extra_config,
            "model": self._settings.model,
            "voice": self._settings.voice,
            "language": None if language is None else str(language),
            "speed": self._speed,
            "response_format": "pcm",
            "sample_rate": self.sample_rate,
            "stream_audio": True,
            "audio_frames": "binary",
            "word_timestamps": True,
        }
        return {k: v for k, v in fields.items() if v is not None}

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self, frame: StartFrame) -> None:
        """Start the service and open its WebSocket (the pipeline's sample rate is known by now)."""
        await super().start(frame)
        await self._connect()

    async def _connect(self) -> None:
        await super()._connect()  # type: ignore[no-untyped-call]
        try:
            await self._connect_websocket()
        except Exception as exc:
            what = str(exc) if isinstance(exc, ConnectError) else f"could not connect to {self._url}: {exc}"
            await self.push_error(error_msg=f"{self}: {what}", exception=exc)
            await self._call_event_handler("on_connection_error", str(exc))
            return
        if self._receive_task is None or self._receive_task.done():
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self) -> None:
        await super()._disconnect()  # type: ignore[no-untyped-call]
        if self._receive_task is not None:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self) -> None:
        """Open the socket and configure the session; raises when the server refuses or does not answer."""
        if self._live():
            return
        ws = await self._dial(self._url)
        session = Session(ws, redial=self._redial)
        try:
            updated = await asyncio.wait_for(session.configure(**self._config_fields()), self._config_timeout)
        except ServerError as exc:
            await session.close()
            raise ConnectionError(f"the server refused the session config: {exc.event.code}: "
                                  f"{exc.event.message}") from None
        except SessionClosedError as exc:
            await session.close()
            raise ConnectionError(f"the server closed the socket before answering session.config "
                                  f"(code {exc.code}: {exc.reason or 'no reason'})") from None
        except BaseException:
            await session.close()
            raise
        self._reset_session_state()
        self._websocket, self._session = ws, session
        self._config_dirty = False
        logger.debug(f"{self}: connected to {self._url} as {updated.session_id} ({updated.engine.name})")
        await self._call_event_handler("on_connected")

    async def _dial(self, url: str) -> ClientConnection:
        return await dial(url, token=self._token, open_timeout=self._config_timeout, shown_url=self._url,
                          opener=self._websocket_connect)

    async def _redial(self, session_id: str) -> ClientConnection:
        """The session's new connection after a drop (it resumes on it): Pipecat's bounded connection too."""
        ws = await self._dial(resume_url(self._url, session_id))
        self._websocket = ws
        return ws

    def _live(self) -> bool:
        """A session is open (its connection may be being resumed: text sent meanwhile is kept for it)."""
        return self._session is not None and not self._session.closed

    async def _disconnect_websocket(self) -> None:
        await self.stop_all_metrics()  # type: ignore[no-untyped-call]
        session, self._session, self._websocket = self._session, None, None
        self._reset_session_state()
        if session is not None:
            try:
                await session.close()
            except Exception as exc:
                logger.debug(f"{self}: error closing the WebSocket: {exc}")
            await self._call_event_handler("on_disconnected")

    def _reset_session_state(self) -> None:
        """Utterance numbering and contexts belong to one server session; a new socket starts afresh."""
        self._contexts.clear()
        self._utterances.clear()
        self._unit = None

    # -- text out ------------------------------------------------------------------------------------

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send `text` as a delta of `context_id`'s utterance (opening one if needed); audio and words
        arrive on the receive task. In sentence mode the sentence is also ended (`input.done`) here."""
        if not self._live() and not self._reconnect_in_progress:
            await self._connect()
        if not self._live():
            yield ErrorFrame(error=f"{self}: not connected to {self._url}")
            return
        try:
            await self._send_text(text, context_id)
            await self.start_tts_usage_metrics(text)
        except Exception as exc:
            yield ErrorFrame(error=f"{self}: sending text failed: {exc}", exception=exc)
            return
        yield None

    async def _send_text(self, text: str, context_id: str) -> None:
        session = self._connected()
        ctx = self._contexts.setdefault(context_id, _Context(context_id))
        if ctx.open is None:
            for other in self._contexts.values():
                if other.open is not None:
                    # The server holds one open utterance at a time (a TTSSpeakFrame inside an LLM turn).
                    await self._end_utterance(other)
            if self._config_dirty:
                await session.configure(**self._config_fields())
                self._config_dirty = False
            ctx.open = _Utterance(session.current_utterance_index, context_id)
            self._utterances[ctx.open.index] = ctx.open
            ctx.pending.add(ctx.open.index)
        ctx.open.parts.append(text)
        await session.send_text(text, context_id=context_id)
        if not self._is_streaming_tokens:
            await self._end_utterance(ctx)

    async def _end_utterance(self, ctx: _Context) -> None:
        ctx.open = None
        await self._connected().done(context_id=ctx.context_id)

    async def flush_audio(self, context_id: str | None = None) -> None:
        """End the context's text: its open utterance gets `input.done`, and the context stops (with a
        `TTSStoppedFrame`) once the server has finished all its utterances."""
        ctx = self._contexts.get(context_id or self.get_active_audio_context_id() or "")
        if ctx is None:
            return
        ctx.flushed = True
        if ctx.open is not None and self._session is not None:
            await self._end_utterance(ctx)
        await self._finish_if_done(ctx)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: cancel the context's utterances on the server (the socket stays open)."""
        await self.stop_all_metrics()  # type: ignore[no-untyped-call]
        ctx = self._contexts.pop(context_id, None)
        if ctx is not None and ctx.pending and self._session is not None:
            try:
                await self._session.cancel(context_id=context_id)
            except Exception as exc:
                logger.debug(f"{self}: input.cancel not sent: {exc}")
        await super().on_audio_context_interrupted(context_id)

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:  # type: ignore[override]
        changed = await super()._update_settings(delta)
        if changed.keys() & {"voice", "model", "language"}:
            self._config_dirty = True
        return changed

    def _connected(self) -> Session:
        if self._session is None:
            raise ConnectionError(f"{self}: not connected")
        return self._session

    # -- events in -----------------------------------------------------------------------------------

    async def _receive_messages(self) -> None:
        """The session's events until its socket closes (then Pipecat's receive loop reconnects)."""
        if self._session is None:
            return
        async for event in self._session:
            await self._on_event(event)

    async def _on_event(self, event: Event) -> None:
        if isinstance(event, AudioData):
            await self._on_audio(event.data)
        elif isinstance(event, AudioStart):
            utterance = self._utterances.get(event.utterance_index)
            if utterance is not None and utterance.base_bytes is None:
                ctx = self._contexts.get(utterance.context_id)
                utterance.base_bytes = ctx.audio_bytes if ctx is not None else 0
            self._unit = (utterance, UnitDecoder(event.format))
        elif isinstance(event, AudioWords):
            await self._on_words(event)
        elif isinstance(event, SessionDone | AudioCancelled):
            await self._on_utterance_finished(event.utterance_index)
        elif isinstance(event, ErrorEvent):
            await self.push_error(error_msg=f"{self}: server error {event.code}: {event.message}")

    async def _on_audio(self, data: bytes) -> None:
        if self._unit is None:
            return
        utterance, decoder = self._unit
        samples = decoder.feed(data)
        ctx = self._contexts.get(utterance.context_id) if utterance is not None else None
        if ctx is None or not len(samples):
            return  # a cancelled or interrupted context: its late audio is dropped
        audio = samples.astype("<i2", copy=False).tobytes()
        ctx.audio_bytes += len(audio)
        await self.append_to_audio_context(
            ctx.context_id, TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=ctx.context_id))

    async def _on_words(self, event: AudioWords) -> None:
        utterance = self._utterances.get(event.utterance_index)
        if utterance is None or utterance.context_id not in self._contexts:
            return
        base_s = (utterance.base_bytes or 0) / (2 * self.sample_rate)
        text = utterance.text()
        await self.add_word_timestamps(
            [(spoken_word(text, w), base_s + w.start_ms / 1000.0) for w in event.words], utterance.context_id)

    async def _on_utterance_finished(self, index: int) -> None:
        utterance = self._utterances.pop(index, None)
        if utterance is None:
            return
        ctx = self._contexts.get(utterance.context_id)
        if ctx is not None:
            ctx.pending.discard(index)
            await self._finish_if_done(ctx)

    async def _finish_if_done(self, ctx: _Context) -> None:
        if not ctx.flushed or ctx.pending or ctx.open is not None:
            return
        self._contexts.pop(ctx.context_id, None)
        if self.audio_context_available(ctx.context_id):
            await self.append_to_audio_context(ctx.context_id, TTSStoppedFrame(context_id=ctx.context_id))
            await self.remove_audio_context(ctx.context_id)

