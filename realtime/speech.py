"""REST speech on the shared pipeline: one request's text -> units -> scheduler/engine -> encoded bytes.

`plan_speech` validates an OpenAI/vllm-omni speech request exactly as the WebSocket validates a
`session.config` (the same `resolve_config`, so the same messages and `param`s), picks the delivery
(`stream`: chunked body; `sse`: `speech.audio.*` events; `whole`: one body with usage headers) and splits
the input into sentence units with the `Segmenter`.

`SpeechSynthesis` runs those units through the same `protocol.output.OutputMachine` and
`realtime.pipeline.UnitRuns` as a WebSocket session, so the same scheduler slots and engine: unit N+1
synthesizes while unit N streams, at most `max_units_in_flight` units are synthesizing or buffered at once,
and audio leaves in text order as soon as the engine yields it. Units render to s16 PCM at the output rate (speed beyond
the engine's native range is a pitch-preserving time stretch, in `UnitRenderer`), and a streaming encoder
(`protocol.encoders`) turns that into the response format. Closing `chunks()` early (client gone) cancels
every unit task, which closes the engine iterators.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import msgspec
from voicewire.protocol.audio import STREAMABLE_FORMATS, codec_rate
from voicewire.protocol.encoders import STREAMING_FORMATS, RestFormat, make_encoder
from voicewire.protocol.engine import (
    NO_TOKENS,
    SpeechParams,
    TokenCounts,
    UnitTooLong,
    VoiceSample,
    speech_fields,
    speech_params,
)
from voicewire.protocol.messages import (
    SAMPLE_RATE_MAX,
    SAMPLE_RATE_MIN,
    AudioWords,
    EffectiveConfig,
    ProtocolError,
    SessionConfig,
    SessionDone,
    StreamingMode,
    WordTiming,
    invalid_field,
    valid_values,
)
from voicewire.protocol.output import OutputMachine
from voicewire.protocol.render import RenderedPiece, estimate_seconds
from voicewire.protocol.segmenter import Segmenter, speakable
from voicewire.protocol.session import ServerFacts, Unit, resolve_config
from voicewire.realtime.context import ServerContext
from voicewire.realtime.openai_errors import OpenAIError, bad_request, from_protocol_error
from voicewire.realtime.pipeline import UnitRuns, decode_reference, needs_reference

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
    streaming_mode: StreamingMode | None = None
    """WebSocket only (as in vllm-omni); refused here by name (`plan_speech`)."""


_decoder: Final = msgspec.json.Decoder(SpeechRequest)
_raw_decoder: Final = msgspec.json.Decoder(float_hook=float)


def decode_speech_request(body: bytes) -> SpeechRequest:
    """Parse and type-check a JSON body, or raise a 400 `OpenAIError` naming the field."""
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise _nested_too_deeply() from None


def decode_json(body: bytes) -> Any:
    """An untyped JSON body (a batch), or a 400 `OpenAIError`. A number too large for a float reads as
    inf, so the field it is in refuses it by name."""
    try:
        return _raw_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"Invalid JSON body: {exc}", None, "invalid_json") from None
    except RecursionError:
        raise _nested_too_deeply() from None


def convert_speech_request(fields: dict[str, Any]) -> SpeechRequest:
    """`decode_speech_request` for an already-parsed object (batch items)."""
    try:
        return msgspec.convert(fields, SpeechRequest)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise _nested_too_deeply() from None


def _nested_too_deeply() -> OpenAIError:
    return bad_request("Invalid JSON body: nested too deeply", None, "invalid_json")


def validation_error(exc: msgspec.DecodeError) -> OpenAIError:
    """A msgspec failure as a 400 naming the field (`invalid_field`)."""
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"Invalid JSON body: {exc}", None, "invalid_json")
    param, detail = invalid_field(exc)
    return bad_request(f"Invalid request: {detail}{valid_values(SpeechRequest, param)}", param)


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
    audio_estimate_s: float
    """Expected audio duration at the requested speed (`estimate_seconds` of every unit)."""
    reference: VoiceSample | None = None
    """`params.ref_audio` decoded (`with_reference`), for a cloning engine."""


def plan_speech(req: SpeechRequest, facts: ServerFacts, *, max_input_chars: int,
                delivery: Delivery | None = None) -> SpeechPlan:
    """Validate `req` against the served engine and plan it, or raise `OpenAIError` (400/404).

    `delivery` forces one (batch items are always `whole`); otherwise: `sse` when `stream_format` is
    "sse" (or `stream` is true without a `stream_format`), `whole` when `stream` is false, the format
    cannot stream (flac) or `word_timestamps` is set (words go in a header), else `stream`. A `whole`
    response expected to run past `max_response_audio_s` is refused (400 `audio_too_long`).
    """
    if len(req.input) > max_input_chars:
        raise bad_request(f"input is {len(req.input)} characters; the limit is {max_input_chars}", "input")
    if not speakable(req.input):
        raise bad_request("input has nothing to speak", "input")
    if req.streaming_mode is not None:
        raise bad_request(f"streaming_mode {req.streaming_mode!r} streams text into a WebSocket session as it "
                          "arrives; a REST request's input is whole, so it cannot apply. Use the WebSocket "
                          "/v1/audio/speech/stream, or stream_format 'audio' or 'sse' for streamed audio",
                          "streaming_mode")
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
        stream_audio=True, split_granularity="sentence", word_timestamps=req.word_timestamps, audio_frames="binary",
        **speech_fields(req))
    try:
        config = resolve_config(session, facts)
    except ProtocolError as exc:
        raise from_protocol_error(exc) from None
    units = split_units(req.input, facts.limits.max_unit_chars)
    estimate = sum(estimate_seconds(unit.text, config) for unit in units)
    limit = facts.limits.max_response_audio_s
    if delivery == "whole" and estimate > limit:
        raise audio_too_long(f"This input at speed {req.speed:g} is about {estimate:.0f} s of audio", limit)
    return SpeechPlan(input=req.input, instructions=req.instructions, units=units, config=config,
                      params=speech_params(req), response_format=req.response_format, delivery=delivery,
                      audio_estimate_s=estimate)


async def with_reference(ctx: ServerContext, plan: SpeechPlan, decoded: dict[str, VoiceSample] | None = None
                         ) -> SpeechPlan:
    """`plan` with its `ref_audio` decoded once, before any unit runs (in a worker thread), when the served
    engine takes one; or raise a 400 `OpenAIError` naming `ref_audio` for audio that does not decode.
    `decoded` caches references by value across the plans of one batch."""
    value = plan.params.ref_audio
    if value is None or not needs_reference(ctx, plan.params):
        return plan
    reference = None if decoded is None else decoded.get(value)
    if reference is None:
        try:
            reference = await asyncio.to_thread(decode_reference, ctx, value)
        except ProtocolError as exc:
            raise from_protocol_error(exc) from None
        if decoded is not None:
            decoded[value] = reference
    return dataclasses.replace(plan, reference=reference)


def audio_too_long(what: str, limit: float) -> OpenAIError:
    """The 400 for a non-streamed response (or batch) past `max_response_audio_s`."""
    return OpenAIError(
        400, f"{what}, more than the {limit:g} s one non-streamed response may hold; stream it (stream_format "
        "'audio' or 'sse'), or send less text, a higher speed or a smaller batch", code="audio_too_long",
        param="input")


@dataclass(slots=True)
class AudioBudget:
    """Seconds of audio a non-streamed response may still hold, and where each of its parts falls on the
    response's timeline; a batch's items share one."""

    limit: float
    spent: float = 0.0
    placed: float = 0.0
    """Expected seconds of the parts placed so far (`place`)."""

    def place(self, seconds: float) -> float:
        """Put a part expected to last `seconds` after those placed before it; the expected seconds of
        audio ahead of it."""
        ahead = self.placed
        self.placed += seconds
        return ahead

    def spend(self, seconds: float) -> None:
        """Count `seconds` more; raise `audio_too_long` once past the limit (the estimate was short)."""
        self.spent += seconds
        if self.spent > self.limit:
            raise audio_too_long("The audio ran long", self.limit)


def split_units(text: str, max_unit_chars: int) -> tuple[TextUnit, ...]:
    """Sentence units of `text` (the WebSocket's `sentence` granularity), without unspeakable ones."""
    segmenter = Segmenter("sentence", max_unit_chars=max_unit_chars)
    segments = [*segmenter.push(text, 0.0), *segmenter.flush()]
    units: list[TextUnit] = []
    for seg in segments:
        stripped = seg.text.strip()
        if speakable(stripped):
            units.append(TextUnit(len(units), stripped, seg.start + seg.text.index(stripped[0])))
    return tuple(units)


@dataclass(slots=True)
class Usage:
    """Speech usage, vllm-omni's split of the input, summed over the request's units (each unit is one
    engine request). From an engine that counts its model's tokens (`EngineCapabilities.counts_tokens`,
    the omni engine's Qwen3-TTS): `text_tokens` the tokens of each unit's text and the instructions in the
    model's text tokenizer, `output_tokens` the codec frames it generated, as vllm-omni's server counts
    them. From another engine: `text_tokens` are characters of `input` plus `instructions` (the unit OpenAI
    bills tts-1 by), `output_tokens` 25 ms frames of audio. `audio_tokens`, from every engine: the
    reference-audio codec tokens fed as voice-cloning conditioning (0 without a reference)."""

    text_tokens: int
    audio_tokens: int
    output_tokens: int

    @property
    def input_tokens(self) -> int:
        return self.text_tokens + self.audio_tokens

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def as_dict(self) -> dict[str, object]:
        """vllm-omni's usage object (`speech.audio.done`, batch items): the totals and the split of the input
        tokens by modality."""
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.total_tokens,
                "input_token_details": {"text_tokens": self.text_tokens, "audio_tokens": self.audio_tokens}}


@dataclass(slots=True)
class SpeechSynthesis:
    """One planned request through the shared pipeline. Iterate `chunks()` once; then read `usage`,
    `words` and `audio_seconds`. `started` is the request's arrival (`time.monotonic()`): it orders the
    units' engine deadlines against every other session's. A non-streamed response spends its audio from
    `budget` (`chunks()` raises `audio_too_long` past it), and takes its place on the budget's timeline when
    it is made: the items of a batch, which share one budget, are due one after another (each from the
    expected end of the items before it), as for one listener hearing them in turn. So a batch holds no
    more of the engine's turns than one session speaking its items, however costly their text: a session
    that arrives after it is served between its items, not behind all of them."""

    ctx: ServerContext
    plan: SpeechPlan
    request_id: str
    started: float
    budget: AudioBudget | None = None
    samples: int = 0
    tokens: TokenCounts = NO_TOKENS
    """What the engine counted, every unit (`AudioPiece.tokens`; see `Usage`)."""
    words: list[WordTiming] = field(default_factory=list)
    due_after_s: float = field(init=False, default=0.0)
    """Expected audio of the parts of the response placed before this one (`AudioBudget.place`)."""

    def __post_init__(self) -> None:
        if self.budget is not None:
            self.due_after_s = self.budget.place(self.plan.audio_estimate_s)

    @property
    def sample_rate(self) -> int:
        return self.plan.config.sample_rate

    @property
    def audio_seconds(self) -> float:
        return self.samples / self.sample_rate

    @property
    def usage(self) -> Usage:
        tokens = self.tokens
        if self.ctx.facts.info.capabilities.counts_tokens:
            return Usage(tokens.text, tokens.audio, tokens.output)
        text_tokens = len(self.plan.input) + len(self.plan.instructions or "")
        return Usage(text_tokens, tokens.audio, math.ceil(self.audio_seconds * AUDIO_TOKENS_PER_SECOND))

    async def chunks(self) -> AsyncGenerator[bytes]:
        """The response body in the requested format, chunk by chunk as units are synthesized.
        Engine failures propagate (after the unit tasks are cancelled). A compressed format is encoded on
        `ctx.audio`'s threads, off the event loop."""
        plan = self.plan
        encoder = make_encoder(plan.response_format, self.sample_rate, streaming=plan.delivery != "whole")
        off_loop = plan.response_format not in STREAMABLE_FORMATS
        try:
            async with aclosing(self._pieces()) as pieces:
                async for piece in pieces:
                    self.samples += piece.samples
                    if self.budget is not None:
                        self.budget.spend(piece.samples / self.sample_rate)
                    data = await self.ctx.audio.run_if(off_loop, encoder.encode, piece.data)
                    if data:
                        yield data
            tail = await self.ctx.audio.run_if(off_loop, encoder.finish)
            if tail:
                yield tail
        finally:
            encoder.close()

    async def _pieces(self) -> AsyncGenerator[RenderedPiece]:
        """Rendered pieces in text order, through the same `OutputMachine` as a WebSocket session (the plan's
        units as one utterance, all committed at the request's arrival, or at its place on a batch's
        timeline); their words, on the output
        timeline, go to `words`. A unit's failure is raised after the pieces before it."""
        config = self.plan.config
        output = OutputMachine(self.ctx.settings.max_units_in_flight)
        wake = asyncio.Event()
        runs = UnitRuns(self.ctx, output, lambda unit: f"{self.request_id}-{unit.sentence_index}", "rest", wake.set,
                        stream=True)
        committed_ms = (self.started + self.due_after_s) * 1000.0
        try:
            for unit in self.plan.units:
                output.commit(Unit(utterance_index=0, sentence_index=unit.index, text=unit.text,
                                   char_start=unit.char_start, char_end=unit.char_start + len(unit.text),
                                   config=config, params=self.plan.params, context_id=None,
                                   committed_ms=committed_ms, reference=self.plan.reference),
                              estimate_seconds(unit.text, config) * 1000.0)
            output.finish_utterance(0, len(self.plan.units))
            runs.settle()
            while True:
                frame = output.next_output(time.monotonic() * 1000.0)
                runs.settle()
                if runs.failed is not None and runs.error is not None:
                    error = runs.error
                    if isinstance(error, UnitTooLong):
                        raise OpenAIError(400, f"Sentence {runs.failed.unit.sentence_index} {error}; send shorter "
                                          "sentences or use a higher speed", code="unit_too_long",
                                          param="input") from error
                    raise error
                if frame is None:
                    wake.clear()
                    await wake.wait()
                elif isinstance(frame, RenderedPiece):
                    yield frame
                elif isinstance(frame, AudioWords):
                    self.words.extend(frame.words)
                elif isinstance(frame, SessionDone):
                    return
        finally:
            # Units left behind (client gone, or a unit failed): those in flight and those never started.
            output.close(announce=False)
            runs.settle()
            await runs.aclose()
            self.tokens = runs.tokens
