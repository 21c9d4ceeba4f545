"""Pipecat integration: `VoicewireTTSService`, a Pipecat TTS service on one persistent voicewire WebSocket.

Install with `pip install "voicewire-client[pipecat]"`, then put the service where any Pipecat TTS goes:

    from voicewire_client.pipecat import VoicewireTTSService

    tts = VoicewireTTSService(url="ws://127.0.0.1:8000/v1/audio/speech/stream", voice="heart")
    pipeline = Pipeline([transport.input(), stt, user_aggregator, llm, tts, transport.output(),
                         assistant_aggregator])

Contracts:
- One WebSocket per service, opened at `StartFrame` and closed at `EndFrame`/`CancelFrame`. It is replaced
  only when it actually dies (the server closed it, the network dropped): then Pipecat's reconnect loop
  retries with exponential backoff (`reconnect_backoff_min_wait` .. `reconnect_backoff_max_wait` seconds).
  Audio still due on the dead socket is lost; the turn in progress moves to a new audio context.
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
- Memory: the service keeps, per open context, the text of its utterances in flight (for word spans) and
  a few counters; audio is handed to Pipecat as it arrives.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, StartFrame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
from pipecat.transcriptions.language import Language
from websockets.asyncio.client import ClientConnection
from websockets.protocol import State

from voicewire_client._agents import Utterance, refuse_owned_fields, word_end
from voicewire_client.audio import UnitDecoder
from voicewire_client.events import (
    AudioCancelled,
    AudioStart,
    AudioWords,
    ErrorEvent,
    SessionDone,
    SessionUpdated,
    WordTiming,
    parse_event,
)
from voicewire_client.session import stream_url

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
        self._session_id: str | None = None
        self._config_dirty = False
        self._contexts: dict[str, _Context] = {}
        self._utterances: dict[int, _Utterance] = {}
        self._next_utterance = 0
        self._unit: tuple[_Utterance | None, UnitDecoder] | None = None

    # -- public surface ------------------------------------------------------------------------------

    @property
    def session_id(self) -> str | None:
        """The server's `session_id` of the current WebSocket; None while disconnected."""
        return self._session_id

    def can_generate_metrics(self) -> bool:
        """TTFB, TTFA and usage metrics are reported."""
        return True

    def session_config(self) -> dict[str, Any]:
        """The `session.config` message this service sends (None values left out)."""
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
        return {"type": "session.config", **{k: v for k, v in fields.items() if v is not None}}

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
            await self.push_error(error_msg=f"{self}: could not connect to {self._url}: {exc}", exception=exc)
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
        if self._websocket is not None and self._websocket.state is State.OPEN:
            return
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        ws: ClientConnection = await self._websocket_connect(self._url, additional_headers=headers, max_size=None)
        try:
            await ws.send(json.dumps(self.session_config()))
            updated = await asyncio.wait_for(_configured(ws), self._config_timeout)
        except BaseException:
            await ws.close()
            raise
        self._reset_session_state()
        self._websocket = ws
        self._session_id = updated.session_id
        self._config_dirty = False
        logger.debug(f"{self}: connected to {self._url} as {updated.session_id} ({updated.engine.name})")
        await self._call_event_handler("on_connected")

    async def _disconnect_websocket(self) -> None:
        await self.stop_all_metrics()  # type: ignore[no-untyped-call]
        ws, self._websocket = self._websocket, None
        self._session_id = None
        self._reset_session_state()
        if ws is not None:
            try:
                await ws.close()
            except Exception as exc:
                logger.debug(f"{self}: error closing the WebSocket: {exc}")
            await self._call_event_handler("on_disconnected")

    def _reset_session_state(self) -> None:
        """Utterance numbering and contexts belong to one server session; a new socket starts afresh."""
        self._contexts.clear()
        self._utterances.clear()
        self._next_utterance = 0
        self._unit = None

    # -- text out ------------------------------------------------------------------------------------

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send `text` as a delta of `context_id`'s utterance (opening one if needed); audio and words
        arrive on the receive task. In sentence mode the sentence is also ended (`input.done`) here."""
        if (self._websocket is None or self._websocket.state is not State.OPEN) and not self._reconnect_in_progress:
            await self._connect()
        if self._websocket is None or self._websocket.state is not State.OPEN:
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
        ctx = self._contexts.setdefault(context_id, _Context(context_id))
        if ctx.open is None:
            for other in self._contexts.values():
                if other.open is not None:
                    # The server holds one open utterance at a time (a TTSSpeakFrame inside an LLM turn).
                    await self._end_utterance(other)
            if self._config_dirty:
                await self._send(self.session_config())
                self._config_dirty = False
            ctx.open = _Utterance(self._next_utterance, context_id)
            self._utterances[ctx.open.index] = ctx.open
            ctx.pending.add(ctx.open.index)
            self._next_utterance += 1
        ctx.open.parts.append(text)
        await self._send({"type": "input.text", "text": text, "context_id": context_id})
        if not self._is_streaming_tokens:
            await self._end_utterance(ctx)

    async def _end_utterance(self, ctx: _Context) -> None:
        ctx.open = None
        await self._send({"type": "input.done", "context_id": ctx.context_id})

    async def flush_audio(self, context_id: str | None = None) -> None:
        """End the context's text: its open utterance gets `input.done`, and the context stops (with a
        `TTSStoppedFrame`) once the server has finished all its utterances."""
        ctx = self._contexts.get(context_id or self.get_active_audio_context_id() or "")
        if ctx is None:
            return
        ctx.flushed = True
        if ctx.open is not None and self._websocket is not None:
            await self._end_utterance(ctx)
        await self._finish_if_done(ctx)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: cancel the context's utterances on the server (the socket stays open)."""
        await self.stop_all_metrics()  # type: ignore[no-untyped-call]
        ctx = self._contexts.pop(context_id, None)
        if ctx is not None and ctx.pending and self._websocket is not None:
            try:
                await self._send({"type": "input.cancel", "context_id": context_id})
            except Exception as exc:
                logger.debug(f"{self}: input.cancel not sent: {exc}")
        await super().on_audio_context_interrupted(context_id)

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:  # type: ignore[override]
        changed = await super()._update_settings(delta)
        if changed.keys() & {"voice", "model", "language"}:
            self._config_dirty = True
        return changed

    async def _send(self, message: dict[str, Any]) -> None:
        if self._websocket is None:
            raise ConnectionError(f"{self}: not connected")
        await self._websocket.send(json.dumps(message))

    # -- events in -----------------------------------------------------------------------------------

    async def _receive_messages(self) -> None:
        if self._websocket is None:
            return
        async for message in self._websocket:
            if isinstance(message, bytes):
                await self._on_audio(message)
            else:
                await self._on_event(json.loads(message))

    async def _on_event(self, data: dict[str, Any]) -> None:
        event = parse_event(data)
        if isinstance(event, AudioStart):
            utterance = self._utterances.get(event.utterance_index)
            if utterance is not None and utterance.base_bytes is None:
                ctx = self._contexts.get(utterance.context_id)
                utterance.base_bytes = ctx.audio_bytes if ctx is not None else 0
            self._unit = (utterance, UnitDecoder(event.format))
        elif isinstance(event, AudioWords):
            await self._on_words(event)
        elif isinstance(event, SessionDone | AudioCancelled):
            await self._on_utterance_finished(event.utterance_index)
        elif isinstance(event, SessionUpdated):
            self._session_id = event.session_id
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


async def _configured(ws: ClientConnection) -> SessionUpdated:
    """The server's answer to the first `session.config`: `session.updated`, or a `ConnectionError`."""
    async for message in ws:
        if isinstance(message, bytes):
            continue
        event = parse_event(json.loads(message))
        if isinstance(event, SessionUpdated):
            return event
        if isinstance(event, ErrorEvent):
            raise ConnectionError(f"the server refused the session config: {event.code}: {event.message}")
    raise ConnectionError(f"the server closed the socket before answering session.config "
                          f"(code {ws.close_code}: {ws.close_reason or 'no reason'})")
