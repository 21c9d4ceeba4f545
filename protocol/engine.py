"""The engine's data types: what an engine is asked (`SynthesisRequest`), what it yields (`AudioPiece`) and
what it tells about itself (`EngineInfo`). Plain data, the ground floor: `adapters/` (the engines) and
`realtime/` both build on these; the `Engine` protocol itself is in `adapters/base.py`.

An engine turns one synthesis unit (a sentence or clause of an utterance) into audio. The shape follows
vLLM's async generator per request: `synthesize(request)` returns an async generator of `AudioPiece`s, and
closing or cancelling that iterator is the only cancel API. Every engine must stop the computation for a
request promptly when its iterator is closed (`aclose()`) or the task consuming it is cancelled, and must
not leak threads, buffers or device memory for it.

Engines do no scheduling across sessions: the realtime scheduler decides which request runs next and how
many run at once (`EngineInfo.max_concurrency`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

FloatAudio = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class WordSpan:
    """One spoken word of a unit.

    `char_start`/`char_end` index the unit's text (Python string offsets, end exclusive) and cover the
    word as written, without surrounding whitespace. `start_sample`/`end_sample` count samples at the
    engine's native rate from the first sample of the unit's audio (end exclusive).
    """

    char_start: int
    char_end: int
    start_sample: int
    end_sample: int


class TokenCounts(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Usage an engine counts in its model's own units, for one piece of a unit (vllm-omni's usage split):
    `text` the tokens of the unit's text and instructions in the model's text tokenizer and `audio` the
    reference-audio codec tokens fed as voice-cloning conditioning, both once, on the unit's first piece;
    `output` the tokens (codec frames) the model generated for this piece. `a + b` sums them.

    `audio` is reported by every engine that feeds reference audio; `text` and `output` only by an engine
    whose `EngineCapabilities.counts_tokens` is set (the others leave them 0, and usage falls back to
    characters and audio time)."""

    text: int = 0
    audio: int = 0
    output: int = 0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(self.text + other.text, self.audio + other.audio, self.output + other.output)


NO_TOKENS: Final = TokenCounts()


@dataclass(frozen=True, slots=True)
class AudioPiece:
    """A run of mono float32 samples in [-1, 1] at `sample_rate`, in playback order.

    `words` holds the spans whose audio ends inside this piece or earlier pieces of the same unit and
    were not reported before; an engine without word timings leaves it empty. `tokens`: what the engine
    counted for this piece (`TokenCounts`).
    """

    samples: FloatAudio
    sample_rate: int
    words: tuple[WordSpan, ...] = ()
    tokens: TokenCounts = NO_TOKENS


SPEED_MIN: Final = 0.25
SPEED_MAX: Final = 4.0


class VoiceReference(msgspec.Struct, forbid_unknown_fields=False):
    """One entry of `references` (Higgs Audio's form of `ref_audio` + `ref_text`)."""

    audio_path: str
    text: str | None = None


class SpeechParams(msgspec.Struct, kw_only=True, frozen=True):
    """What to synthesize besides the text and the voice: the engine's request fields, one typed vocabulary.

    The WebSocket `session.config` (`messages.SessionConfig`) and the REST speech request
    (`realtime.speech.SpeechRequest`) both inherit these fields with their bounds, and the engine receives
    them as typed fields of `SynthesisRequest`. A field left at None is "not asked for". Every other field
    must be honoured by the engine (`EngineCapabilities.fields`, or `.values` for fields it honours with
    some values only), or it is refused (`unhonoured`, driven by those capabilities): never
    ignored silently. `speed` is always honoured (beyond the engine's native range by a time stretch).

    Adding a field: declare it here, name it in the `EngineKind.fields` of each engine kind that honours it
    (`adapters/registry.py`; the engines build their capabilities from those), and read it in that engine's
    `synthesize`. Nothing else changes.
    """

    speed: Annotated[float, msgspec.Meta(ge=SPEED_MIN, le=SPEED_MAX)] = 1.0
    language: str | None = None
    """Checked against `EngineInfo.languages` rather than a capability."""
    instructions: str | None = None
    task_type: str | None = None
    """vllm-omni's task (`CustomVoice`, `VoiceDesign`, `Base`)."""
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    speaker_embedding: list[float] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    initial_codec_chunk_frames: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    non_streaming_mode: bool | None = None
    ref_audio_2: str | None = None
    ambient_sound: str | None = None
    duration_seconds: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    references: list[VoiceReference] | None = None
    extra_params: dict[str, Any] | None = None


SPEECH_FIELDS: Final[tuple[str, ...]] = SpeechParams.__struct_fields__


def speech_fields(source: SpeechParams) -> dict[str, Any]:
    """The `SpeechParams` fields of `source` (a `SessionConfig`, a `SpeechRequest`, ...) by name, to pass on
    as keyword arguments."""
    return {name: getattr(source, name) for name in SPEECH_FIELDS}


def speech_params(source: SpeechParams) -> SpeechParams:
    """The `SpeechParams` part of `source`, field for field."""
    return SpeechParams(**speech_fields(source))


class VoiceSample(msgspec.Struct, frozen=True):
    """Reference audio for a cloning engine, decoded by the server: mono float32 samples in native byte
    order (`pcm`) at `sample_rate`. Bytes rather than an array, so a request stays plain data."""

    pcm: bytes
    sample_rate: int

    @classmethod
    def of(cls, samples: FloatAudio, sample_rate: int) -> VoiceSample:
        return cls(np.ascontiguousarray(samples, dtype=np.float32).tobytes(), int(sample_rate))

    def samples(self) -> FloatAudio:
        return np.frombuffer(self.pcm, dtype=np.float32)


class SynthesisRequest(SpeechParams, kw_only=True, frozen=True):
    """One unit to synthesize: its text, the engine voice, and every `SpeechParams` field as accepted.

    `speed` is within the engine's native range (`EngineCapabilities.speed_range`); the caller does any
    time-stretch beyond it. `seed`, when set, makes the audio of the same request reproducible. Fields
    the engine does not name in `EngineCapabilities.fields` are always None here (they were refused).
    `request_id` is unique per server and is what the engine logs and aborts by.

    `reference` is set for cloning engines (`EngineCapabilities.voice_cloning`) only: the request's
    `ref_audio` decoded, or the uploaded voice `voice` names (then `ref_text` is the voice's stored
    transcript unless the request gave one, and `x_vector_only_mode` is true when there is none).
    """

    request_id: str
    text: str
    voice: str
    reference: VoiceSample | None = None


WHOLE_UNIT_VALUES: Final[Mapping[str, tuple[object, ...]]] = {
    "task_type": ("CustomVoice",), "non_streaming_mode": (True,)}
"""What an engine that speaks its own voices from a unit's whole text is: vllm-omni's `CustomVoice` task,
in its non-streaming (whole text first) prompt mode."""


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine can honour; requests asking for anything else are refused (`unhonoured`)."""

    word_timings: bool
    voice_cloning: bool
    speed_range: tuple[float, float]
    streaming: str = "unit"
    """`unit`: each request yields its audio once it is computed; `frame`: audio arrives in small chunks."""
    fields: frozenset[str] = frozenset()
    """The optional `SpeechParams` fields the engine acts on, whatever their value (`seed`, ...)."""
    values: Mapping[str, tuple[object, ...]] = field(default_factory=lambda: dict(WHOLE_UNIT_VALUES))
    """Fields the engine honours with these values only (it always works that way)."""
    counts_tokens: bool = False
    """The engine reports its model's text and output tokens (`TokenCounts`); usage uses them."""

    def __post_init__(self) -> None:
        _check_field_names("EngineCapabilities", self.fields, self.values)


def _check_field_names(what: str, fields: frozenset[str], values: Mapping[str, object]) -> None:
    unknown = (fields | set(values)) - set(SPEECH_FIELDS)
    if unknown:
        raise ValueError(f"{what}.fields names no request field: {', '.join(sorted(unknown))}")


@dataclass(frozen=True, slots=True)
class EngineKind:
    """One kind of engine of this build (an engine, or one checkpoint kind or model family an engine serves)
    and what it honours, declared statically (`adapters/registry.py`) whether or not it is the one served,
    so that a refusal names the engines that would honour the field (`engines_that_can`). An engine builds
    its `EngineCapabilities` from its kind's `fields` and `values` (narrowing them where its start flags do)."""

    engine: str
    variant: str | None = None
    """The checkpoint kind or model family, for an engine that serves several (`Qwen3-TTS VoiceDesign`)."""
    fields: frozenset[str] = frozenset()
    values: Mapping[str, tuple[object, ...]] = field(default_factory=lambda: dict(WHOLE_UNIT_VALUES))
    word_timings: bool = False

    def __post_init__(self) -> None:
        _check_field_names("EngineKind", self.fields, self.values)

    @property
    def label(self) -> str:
        """How a refusal names it: `talker`, `omni (Qwen3-TTS Base)`."""
        return self.engine if self.variant is None else f"{self.engine} ({self.variant})"

    def honours(self, name: str, value: object) -> bool:
        """Whether it honours the request field `name` asked with `value`."""
        return name in self.fields or value in self.values.get(name, ())


def engines_that_can(kinds: Sequence[EngineKind], can: Callable[[EngineKind], bool]) -> str:
    """The end of a refusal: `engines that can: talker, omni (Qwen3-TTS Base)`, the `kinds` for which `can`
    holds, in their order, or `no engine of this build can`."""
    able = [kind.label for kind in kinds if can(kind)]
    return f"engines that can: {', '.join(able)}" if able else "no engine of this build can"


_WHY_NOT: Final[dict[str, str]] = {
    **dict.fromkeys(("ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding", "ref_audio_2",
                     "references"), "it cannot clone voices"),
    **dict.fromkeys(("max_new_tokens", "initial_codec_chunk_frames"), "it is not a codec-token engine"),
}
"""Why an engine without a field cannot honour it, where there is more to say than "it cannot"."""


def unhonoured(params: SpeechParams, capabilities: EngineCapabilities) -> tuple[str, str] | None:
    """The first field of `params` an engine with `capabilities` cannot honour, and why; None when there
    is none. A field counts as asked for unless it is None or empty ("", [], {}); `speed` and `language`
    are not capabilities (see `SpeechParams`)."""
    for name in SPEECH_FIELDS:
        value = getattr(params, name)
        if name in ("speed", "language") or value is None or (isinstance(value, str | list | dict) and not value):
            continue
        if name in capabilities.fields:
            continue
        allowed = capabilities.values.get(name)
        if allowed is None:
            return name, _WHY_NOT.get(name, "it cannot honour it")
        if value not in allowed:
            return name, f"it only serves {name} {', '.join(map(str, allowed))}"
    return None


def conflicting_voice_source(params: SpeechParams, uploaded_voice: str | None) -> tuple[str, str] | None:
    """The field of `params` that clashes with another source of the cloned voice, and why; None when there
    is no clash. `speaker_embedding` is a whole voice by itself (vllm-omni's x-vector), so it cannot be
    combined with `ref_audio` nor with the uploaded voice `uploaded_voice` (the request's `voice`, when it
    names one): vllm-omni takes them as mutually exclusive, and no engine here picks one silently."""
    if not params.speaker_embedding:
        return None
    if params.ref_audio:
        return "speaker_embedding", "cannot be combined with ref_audio; send one voice source, not both"
    if uploaded_voice is not None:
        return "speaker_embedding", (f"cannot be combined with voice {uploaded_voice!r} (an uploaded voice); "
                                     "send one voice source, not both")
    return None


def default_task_type(capabilities: EngineCapabilities) -> str:
    """The vllm-omni task an engine runs when a request names none: the first it serves."""
    return str(capabilities.values.get("task_type", WHOLE_UNIT_VALUES["task_type"])[0])


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Static facts about a started engine, published to clients in `session.updated.engine`."""

    name: str
    sample_rate: int
    voices: tuple[str, ...]
    default_voice: str
    languages: tuple[str, ...]
    capabilities: EngineCapabilities
    max_concurrency: int
    """How many requests the engine computes at once; the scheduler never runs more than this."""
    model_ids: tuple[str, ...] = ()
    """The ids its model is known by besides the engine's name, as vllm-omni's server reports them in
    `/v1/models` (the model path as given, the HF-style `org/name`); accepted as `model`, and published."""


class EngineError(Exception):
    """A unit the engine could not synthesize. `code` is the stable error code clients get for it (the
    WebSocket `error` event's `code`, REST's `error.code`); the message is for humans. Engines raise
    subclasses, each naming its code as a class attribute (an error relayed from a worker process carries
    the original's code on the instance); any other exception out of an engine is a bug of the engine and
    reported as `generation_failed` too (`failure_of`)."""

    code: str = "generation_failed"


class EngineWorkerLost(EngineError):
    """The process computing the unit exited; the unit is lost, the server is not."""


class UnitTimeout(EngineError):
    """A unit's engine work ran past the server's per-unit limit (`unit_timeout_s`); it was cancelled."""

    code = "unit_timeout"


class UnitTooLong(EngineError):
    """A unit's audio ran past the server's per-unit limit (`max_unit_audio_s`); it was stopped."""

    code = "unit_too_long"


def failure_of(exc: BaseException) -> tuple[str, str]:
    """(code, reason) of a unit's failure: the one mapping from engine exceptions to error codes."""
    code = exc.code if isinstance(exc, EngineError) else EngineError.code
    return code, str(exc) or type(exc).__name__
