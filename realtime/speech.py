"""REST speech on the shared pipeline: one request's text -> units -> scheduler/engine -> encoded bytes.

`plan_speech` validates an OpenAI/vllm-omni speech request exactly as the WebSocket validates a
`session.config` (the same `resolve_config`, so the same messages and `param`s), picks the delivery
(`stream`: chunked body; `sse`: `speech.audio.*` events; `whole`: one body with usage headers) and splits
the input into sentence units with the `Segmenter`.

`SpeechSynthesis` runs those units through `realtime.pipeline` (`render_plan`, `synthesis_request`,
`UnitRun`), the same scheduler slots and engine as WebSocket sessions: unit N+1 synthesizes while
unit N streams, at most `max_units_in_flight` units are synthesizing or buffered at once, and audio leaves
in text order as soon as the engine yields it. Units render to s16 PCM at the output rate (speed beyond
the engine's native range is a pitch-preserving time stretch, in `UnitRenderer`), and a streaming encoder
(`realtime.encoders`) turns that into the response format. Closing `chunks()` early (client gone) cancels
every unit task, which closes the engine iterators.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import msgspec
from voicewire.protocol.audio import codec_rate
from voicewire.protocol.encoders import STREAMING_FORMATS, RestFormat, make_encoder
from voicewire.protocol.engine import SpeechParams, speech_fields, speech_params
from voicewire.protocol.messages import (
    SAMPLE_RATE_MAX,
    SAMPLE_RATE_MIN,
    EffectiveConfig,
    ProtocolError,
    SessionConfig,
    WordTiming,
    invalid_field,
)
from voicewire.protocol.render import RenderedPiece, estimate_seconds, place_words
from voicewire.protocol.segmenter import Segmenter
from voicewire.protocol.session import ServerFacts, resolve_config
from voicewire.realtime.context import ServerContext
from voicewire.realtime.openai_errors import OpenAIError, bad_request, from_protocol_error
from voicewire.realtime.pipeline import UnitRun

Delivery = Literal["stream", "sse", "whole"]

AUDIO_TOKENS_PER_SECOND: Final = 40
"""Usage counts output audio in 25 ms frames (hibari's duration unit), 40 tokens per second."""


class VoiceRef(msgspec.Struct, forbid_unknown_fields=False):
    """OpenAI's `{"id": "voice_..."}` form of `voice`."""

    id: str


class SpeechRequest(SpeechParams, kw_only=True, frozen=True):
    """`POST /v1/audio/speech`: OpenAI's fields plus vllm-omni's extras; the engine's request fields
    (`SpeechParams`) are the WebSocket's. Unknown fields are ignored."""

    input: str
    model: str | None = None
    voice: str | VoiceRef | None = None
    speaker: str | None = None
    response_format: RestFormat = "mp3"
    stream_format: Literal["audio", "sse"] | None = None
    stream: bool | None = None
    sample_rate: Annotated[int, msgspec.Meta(ge=SAMPLE_RATE_MIN, le=SAMPLE_RATE_MAX)] | None = None
    word_timestamps: bool = False


_decoder: Final = msgspec.json.Decoder(SpeechRequest)


def decode_speech_request(body: bytes) -> SpeechRequest:
    """Parse and type-check a JSON body, or raise a 400 `OpenAIError` naming the field."""
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise validation_error(exc) from None


def convert_speech_request(fields: dict[str, Any]) -> SpeechRequest:
    """`decode_speech_request` for an already-parsed object (batch items)."""
    try:
        return msgspec.convert(fields, SpeechRequest)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: msgspec.DecodeError) -> OpenAIError:
    """A msgspec failure as a 400 naming the field (`invalid_field`)."""
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"Invalid JSON body: {exc}", None, "invalid_json")
    param, detail = invalid_field(exc)
    return bad_request(f"Invalid request: {detail}", param)


@dataclass(frozen=True, slots=True)
class TextUnit:
    """One synthesis unit of the input: `text == input[char_start:char_end]`, stripped."""

    index: int
    text: str
    char_start: int


@dataclass(frozen=True, slots=True)
class SpeechPlan:
    """A validated request: what to say, how to render it (`config` renders s16 PCM at the output rate)
    and how to deliver it."""

    input: str
    instructions: str | None
    units: tuple[TextUnit, ...]
    config: EffectiveConfig
    params: SpeechParams
    response_format: RestFormat
    delivery: Delivery


def plan_speech(req: SpeechRequest, facts: ServerFacts, *, max_input_chars: int,
                delivery: Delivery | None = None) -> SpeechPlan:
    """Validate `req` against the served engine and plan it, or raise `OpenAIError` (400/404).

    `delivery` forces one (batch items are always `whole`); otherwise: `sse` when `stream_format` is
    "sse" (or `stream` is true without a `stream_format`), `whole` when `stream` is false, the format
    cannot stream (flac) or `word_timestamps` is set (words go in a header), else `stream`.
    """
    if len(req.input) > max_input_chars:
        raise bad_request(f"input is {len(req.input)} characters; the limit is {max_input_chars}", "input")
    if not any(ch.isalnum() for ch in req.input):
        raise bad_request("input has nothing to speak", "input")
    explicit_stream = req.stream_format is not None or req.stream is not None
    if delivery is None:
        if req.stream_format == "sse" or (req.stream_format is None and req.stream is True):
            delivery = "sse"
        elif (req.stream is False or req.response_format not in STREAMING_FORMATS
              or (req.word_timestamps and not explicit_stream)):
            delivery = "whole"
        else:
            delivery = "stream"
    if req.word_timestamps and delivery != "whole":
        raise bad_request("word_timestamps come in the X-Word-Timestamps header of a non-streaming response; "
                          "drop stream/stream_format, or use the WebSocket /v1/audio/speech/stream for "
                          "streamed words", "word_timestamps")
    voice = req.voice.id if isinstance(req.voice, VoiceRef) else req.voice
    rate = codec_rate(req.response_format, req.sample_rate or facts.engine.sample_rate)
    session = SessionConfig(
        model=req.model, voice=voice, speaker=req.speaker, response_format="pcm", sample_rate=rate,
        stream_audio=True, split_granularity="sentence", word_timestamps=req.word_timestamps,
        **speech_fields(req))
    try:
        config = resolve_config(session, facts)
    except ProtocolError as exc:
        raise from_protocol_error(exc) from None
    return SpeechPlan(input=req.input, instructions=req.instructions,
                      units=split_units(req.input, facts.limits.max_unit_chars), config=config,
                      params=speech_params(req), response_format=req.response_format, delivery=delivery)


def split_units(text: str, max_unit_chars: int) -> tuple[TextUnit, ...]:
    """Sentence units of `text` (the WebSocket's `sentence` granularity), without unspeakable ones."""
    segmenter = Segmenter("sentence", max_unit_chars=max_unit_chars)
    segments = [*segmenter.push(text, 0.0), *segmenter.flush()]
    units: list[TextUnit] = []
    for seg in segments:
        stripped = seg.text.strip()
        if any(ch.isalnum() for ch in stripped):
            units.append(TextUnit(len(units), stripped, seg.start + seg.text.index(stripped[0])))
    return tuple(units)


@dataclass(slots=True)
class Usage:
    """OpenAI's speech usage: input tokens are characters of `input` plus `instructions` (the unit
    OpenAI bills tts-1 by), output tokens 25 ms frames of audio."""

    input_tokens: int
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def as_dict(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.total_tokens}


@dataclass(slots=True)
class SpeechSynthesis:
    """One planned request through the shared pipeline. Iterate `chunks()` once; then read `usage`,
    `words` and `audio_seconds`. `started` is the request's arrival (`time.monotonic()`): it orders the
    units' engine deadlines against every other session's."""

    ctx: ServerContext
    plan: SpeechPlan
    request_id: str
    started: float
    samples: int = 0
    engine_s: float = 0.0
    words: list[WordTiming] = field(default_factory=list)

    @property
    def sample_rate(self) -> int:
        return self.plan.config.sample_rate

    @property
    def audio_seconds(self) -> float:
        return self.samples / self.sample_rate

    @property
    def usage(self) -> Usage:
        text_tokens = len(self.plan.input) + len(self.plan.instructions or "")
        return Usage(text_tokens, math.ceil(self.audio_seconds * AUDIO_TOKENS_PER_SECOND))

    async def chunks(self) -> AsyncGenerator[bytes]:
        """The response body in the requested format, chunk by chunk as units are synthesized.
        Engine failures propagate (after the unit tasks are cancelled)."""
        plan = self.plan
        encoder = make_encoder(plan.response_format, self.sample_rate, streaming=plan.delivery != "whole")
        try:
            async with aclosing(self._pieces()) as pieces:
                async for unit, offset_ms, piece in pieces:
                    self.samples += piece.samples
                    self.ctx.metrics.audio_seconds.labels("rest").inc(piece.samples / self.sample_rate)
                    if plan.config.word_timestamps and piece.words:
                        self.words.extend(place_words(piece.words, unit.text, unit.char_start, offset_ms))
                    data = encoder.encode(piece.data)
                    if data:
                        yield data
            tail = encoder.finish()
            if tail:
                yield tail
        finally:
            encoder.close()

    async def _pieces(self) -> AsyncGenerator[tuple[TextUnit, float, RenderedPiece]]:
        """Rendered pieces in text order with their unit and the unit's offset (ms) in the output."""
        units = self.plan.units
        cap = self.ctx.settings.max_units_in_flight
        metrics = self.ctx.metrics
        wake = asyncio.Event()
        runs: deque[tuple[TextUnit, UnitRun]] = deque()
        started = 0
        estimate_s = 0.0
        try:
            while runs or started < len(units):
                while started < len(units) and len(runs) < cap:
                    unit = units[started]
                    runs.append((unit, UnitRun.start(self.ctx, f"{self.request_id}-{unit.index}", unit.text,
                                                     self.plan.config, self.plan.params,
                                                     self.started + estimate_s, wake.set, stream=True)))
                    estimate_s += estimate_seconds(unit.text, self.plan.config)
                    started += 1
                unit, run = runs[0]
                offset_ms = self.samples * 1000.0 / self.sample_rate
                while run.outbox or not run.done:
                    if run.outbox:
                        yield unit, offset_ms, run.outbox.popleft()
                    else:
                        wake.clear()
                        await wake.wait()
                runs.popleft()
                if run.error is not None:
                    metrics.units.labels("failed").inc()
                    raise run.error
                metrics.units.labels("ok").inc()
                self.engine_s += run.engine_s
        finally:
            # Units left behind (client gone, or a unit failed): those in flight and those never started.
            metrics.units.labels("cancelled").inc(len(runs) + len(units) - started)
            for _, run in runs:
                run.task.cancel()
            await asyncio.gather(*(run.task for _, run in runs), return_exceptions=True)
