"""From engine audio to what a client receives for one unit: speed, rate, format, timeline.

`render_plan` says how a unit under a config is rendered and `synthesis_request` what its engine is asked;
`UnitRenderer` is fed the engine's `AudioPiece`s of one unit in order and returns the bytes to send in
the negotiated format, plus the unit's words on the unit's own timeline (milliseconds from the unit's
first output sample; `place_words` moves them onto the utterance timeline). Pure: no I/O, no clock.

Memory: a streaming renderer holds only the resampler's and time-stretcher's tails; a whole-file renderer
(`stream_audio=false`, or a compressed format) holds the unit's audio until `finish()`, bounded by the
unit size cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from voicewire.protocol.audio import STREAMABLE_FORMATS, AudioFormat, StreamResampler, float_to_pcm16, time_stretch
from voicewire.protocol.encoders import make_encoder
from voicewire.protocol.engine import (
    NO_TOKENS,
    AudioPiece,
    EngineInfo,
    FloatAudio,
    SpeechParams,
    SynthesisRequest,
    TokenCounts,
    VoiceSample,
    WordSpan,
    speech_fields,
)
from voicewire.protocol.messages import EffectiveConfig, WordTiming


@dataclass(frozen=True, slots=True)
class RenderPlan:
    """How one unit's audio is shaped.

    `engine_speed` goes to the engine (inside its native range); `stretch` is the pitch-preserving
    tempo factor applied afterwards (1.0 = none), so the heard speed is `engine_speed * stretch`.
    """

    response_format: AudioFormat
    stream: bool
    native_rate: int
    output_rate: int
    engine_speed: float
    stretch: float

    @property
    def costly(self) -> bool:
        """Whether rendering does more than convert samples: a time-stretch, a resample or a compressed
        encoder (milliseconds of CPU per piece and more; `realtime` runs such feeds off its event loop)."""
        return (self.stretch != 1.0 or self.native_rate != self.output_rate
                or self.response_format not in STREAMABLE_FORMATS)


def plan_speed(speed: float, native_range: tuple[float, float]) -> tuple[float, float]:
    """Split a requested speed into (engine speed, extra time-stretch factor)."""
    lo, hi = native_range
    engine_speed = min(max(speed, lo), hi)
    return engine_speed, speed / engine_speed


@dataclass(slots=True)
class RenderedPiece:
    """Bytes to send now (may be empty), the output samples they hold, and the words whose audio is in
    or before them (unit ms)."""

    data: bytes
    samples: int
    words: list[tuple[int, int, float, float]] = field(default_factory=list)
    """(char_start, char_end, start_ms, end_ms) on the unit timeline, char offsets into the unit text."""
    tokens: TokenCounts = NO_TOKENS
    """The engine piece's `AudioPiece.tokens` (usage), passed on even when `data` is held."""


class UnitRenderer:
    """Renders one unit. Call `feed` per engine piece, then `finish` once (or `close` to abandon the
    unit); not reusable. The bytes come from the unit's encoder (`protocol.encoders`, the family REST
    uses too): streamed as they are ready, or held and sent whole by `finish` for a non-streaming plan."""

    def __init__(self, plan: RenderPlan) -> None:
        self.plan = plan
        self._resampler = StreamResampler(plan.native_rate, plan.output_rate)
        self._encoder = make_encoder(plan.response_format, plan.output_rate, streaming=plan.stream)
        self._held: list[bytes] = []
        self._held_samples = 0
        self.output_samples = 0
        self.output_bytes = 0

    @property
    def audio_ms(self) -> float:
        return self.output_samples * 1000.0 / self.plan.output_rate

    def feed(self, piece: AudioPiece) -> RenderedPiece:
        if piece.sample_rate != self.plan.native_rate:
            raise ValueError(f"engine piece at {piece.sample_rate} Hz, expected {self.plan.native_rate} Hz")
        words = self._words(piece.words)
        audio = piece.samples
        if self.plan.stretch != 1.0:
            audio = time_stretch(audio, self.plan.native_rate, self.plan.stretch)
        audio = self._resampler.process(audio)
        return self._emit(audio, words, piece.tokens)

    def finish(self) -> RenderedPiece:
        """The rest of the unit (for a non-streaming unit: the whole file and all its samples)."""
        tail = self._emit(self._resampler.process(np.zeros(0, np.float32), last=True), [])
        end = self._encoder.finish()
        self._encoder.close()
        if self.plan.stream:
            self.output_bytes += len(end)
            return RenderedPiece(tail.data + end, tail.samples)
        data = b"".join(self._held) + end
        self._held.clear()
        self.output_bytes = len(data)
        return RenderedPiece(data, self._held_samples)

    def close(self) -> None:
        """Drop the unit without finishing its file (it was cancelled or failed); idempotent."""
        self._held.clear()
        self._encoder.close()

    def _emit(self, audio: FloatAudio, words: list[tuple[int, int, float, float]],
              tokens: TokenCounts = NO_TOKENS) -> RenderedPiece:
        self.output_samples += len(audio)
        data = self._encoder.encode(float_to_pcm16(audio))
        if not self.plan.stream:
            self._held.append(data)
            self._held_samples += len(audio)
            return RenderedPiece(b"", 0, words, tokens)
        self.output_bytes += len(data)
        return RenderedPiece(data, len(audio), words, tokens)

    def _words(self, spans: tuple[WordSpan, ...]) -> list[tuple[int, int, float, float]]:
        scale = 1000.0 / (self.plan.native_rate * self.plan.stretch)
        return [(w.char_start, w.char_end, w.start_sample * scale, w.end_sample * scale) for w in spans]


SECONDS_PER_CHAR_ESTIMATE = 0.065
"""Rough speech duration of one character (`estimate_seconds`)."""


def estimate_seconds(text: str, config: EffectiveConfig) -> float:
    """Expected audio duration of `text` under `config`, for playback deadlines of units not yet heard."""
    return len(text) * SECONDS_PER_CHAR_ESTIMATE / config.speed


def render_plan(config: EffectiveConfig, info: EngineInfo, *, stream: bool | None = None) -> RenderPlan:
    """How a unit under `config` is rendered: engine speed, extra time-stretch, rates, format."""
    engine_speed, stretch = plan_speed(config.speed, info.capabilities.speed_range)
    return RenderPlan(response_format=config.response_format,
                      stream=config.stream_audio if stream is None else stream,
                      native_rate=info.sample_rate, output_rate=config.sample_rate,
                      engine_speed=engine_speed, stretch=stretch)


def synthesis_request(request_id: str, text: str, config: EffectiveConfig, params: SpeechParams,
                      plan: RenderPlan, reference: VoiceSample | None = None) -> SynthesisRequest:
    """The engine request for one unit: `params` as accepted (`resolve_config` refused what the engine
    cannot honour), the resolved voice of `config`, the engine's share of the speed (`plan`) and the
    decoded `ref_audio` (`reference`)."""
    return SynthesisRequest(request_id=request_id, text=text, voice=config.voice, reference=reference,
                            **{**speech_fields(params), "speed": plan.engine_speed})


def place_words(
    words: list[tuple[int, int, float, float]], unit_text: str, unit_char_start: int, unit_offset_ms: float
) -> list[WordTiming]:
    """Move unit-relative words onto the utterance timeline and utterance character offsets."""
    return [
        WordTiming(word=unit_text[cs:ce], start_ms=round(unit_offset_ms + s),
                   end_ms=round(unit_offset_ms + e), char_start=unit_char_start + cs,
                   char_end=unit_char_start + ce)
        for cs, ce, s, e in words
    ]
