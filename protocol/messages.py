"""Wire types of the WebSocket protocol (`/v1/audio/speech/stream`) and their one decoder.

Client messages are JSON objects in text frames, tagged by `type`; `decode_client_message` is the single
place they are parsed and validated (msgspec does both in one pass), and its failures become
`ProtocolError`s whose `code` and `message` go to the client in an `error` event. Unknown fields are
ignored (forward compatibility); unknown types are an error.

Server events are msgspec Structs tagged by `type` as well; `encode_event` renders them. Optional fields
left at `None` are omitted from the JSON, except where vllm-omni clients expect them present (those
fields have non-None defaults or are always set).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

import msgspec
from voicewire.protocol.audio import AudioFormat
from voicewire.protocol.engine import SpeechParams
from voicewire.protocol.segmenter import SplitGranularity

AudioFrames = Literal["binary", "json"]

SAMPLE_RATE_MIN: Final = 8000
SAMPLE_RATE_MAX: Final = 48000


class ProtocolError(Exception):
    """A client mistake. `code` is stable and documented; `message` is for humans; `fatal` closes.
    `reason`, when set, is a finer stable code for REST's twin of the error (`model_not_found`,
    `voice_not_found`); the WebSocket sends `code` only."""

    def __init__(self, code: str, message: str, *, fatal: bool = False, param: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal
        self.param = param
        self.reason = reason


# ---------------------------------------------------------------------------------------------------
# Client -> server


class SessionConfig(SpeechParams, tag="session.config", tag_field="type", kw_only=True, frozen=True):
    """Session settings: the engine's request fields (`SpeechParams`, shared with REST) and the session's
    own. Every field is optional; `None` means "server default" (see `protocol.session.resolve_config`)."""

    model: str | None = None
    voice: str | None = None
    speaker: str | None = None
    response_format: AudioFormat = "wav"
    sample_rate: Annotated[int, msgspec.Meta(ge=SAMPLE_RATE_MIN, le=SAMPLE_RATE_MAX)] | None = None
    stream_audio: bool = False
    split_granularity: SplitGranularity = "none"
    max_buffer_delay_ms: Annotated[int, msgspec.Meta(ge=0, le=5000)] = 0
    word_timestamps: bool = False
    audio_frames: AudioFrames | None = None


class InputText(msgspec.Struct, tag="input.text", tag_field="type", kw_only=True):
    text: str = ""
    context_id: str | None = None


class InputDone(msgspec.Struct, tag="input.done", tag_field="type", kw_only=True):
    context_id: str | None = None


class InputCancel(msgspec.Struct, tag="input.cancel", tag_field="type", kw_only=True):
    context_id: str | None = None


class SessionClose(msgspec.Struct, tag="session.close", tag_field="type", kw_only=True):
    pass


ClientMessage = SessionConfig | InputText | InputDone | InputCancel | SessionClose
CLIENT_MESSAGE_TYPES: Final = ("session.config", "input.text", "input.done", "input.cancel", "session.close")

_decoder: Final = msgspec.json.Decoder(ClientMessage)
_raw_decoder: Final = msgspec.json.Decoder()


def decode_client_message(data: str | bytes) -> ClientMessage:
    """Decode and validate one client text frame, or raise `ProtocolError`.

    Codes and texts (the texts are vllm-omni's where it has one): `invalid_json` "Invalid JSON message";
    `invalid_message` "WebSocket messages must be JSON objects", "JSON nested too deeply" (past the
    interpreter's recursion limit, about 1000 levels) or a field error; `unknown_type`
    "Unknown message type: X"; `invalid_config` "Invalid session config: ..." (a field out of range or
    of the wrong type); `invalid_text` "input.text requires a string value". `fatal` is left False: the
    session state machine decides (every mistake before the first config is fatal, as in vllm-omni).
    """
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _classify(data, exc) from None
    except msgspec.DecodeError:
        raise ProtocolError("invalid_json", "Invalid JSON message") from None
    except RecursionError:
        raise ProtocolError("invalid_message", "JSON nested too deeply") from None


_FIELD_AT: Final = re.compile(r" - at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING_FIELD: Final = re.compile(r"missing required field `([^`]+)`")


def invalid_field(exc: msgspec.ValidationError) -> tuple[str | None, str]:
    """(param, detail) of a msgspec validation error: the top-level request field it is about (the first
    component of its path, else the missing field; None when it names neither) and msgspec's own text.
    The one reading of msgspec's messages, for the WebSocket and REST decoders alike."""
    detail = str(exc)
    match = _FIELD_AT.search(detail) or _MISSING_FIELD.search(detail)
    return (match.group(1) if match else None), detail


def _classify(data: str | bytes, exc: msgspec.ValidationError) -> ProtocolError:
    try:
        raw: Any = _raw_decoder.decode(data)
    except RecursionError:
        return ProtocolError("invalid_message", "JSON nested too deeply")
    if not isinstance(raw, dict):
        return ProtocolError("invalid_message", "WebSocket messages must be JSON objects")
    kind = raw.get("type")
    if kind not in CLIENT_MESSAGE_TYPES:
        return ProtocolError("unknown_type", f"Unknown message type: {kind}")
    field, detail = invalid_field(exc)
    if kind == "session.config":
        return ProtocolError("invalid_config", f"Invalid session config: {detail}", param=field)
    if kind == "input.text" and field == "text":
        return ProtocolError("invalid_text", "input.text requires a string value", param="text")
    return ProtocolError("invalid_message", f"Invalid {kind}: {detail}")


# ---------------------------------------------------------------------------------------------------
# Server -> client


class Limits(msgspec.Struct, kw_only=True):
    """Published limits; every one is enforced with a documented error or close code."""

    config_timeout_s: float
    idle_timeout_s: float
    stall_timeout_s: float
    max_message_bytes: int
    max_config_bytes: int
    max_utterance_chars: int
    max_unit_chars: int
    max_units_in_flight: int
    max_sessions: int
    max_sessions_per_key: int
    max_sessions_per_ip: int
    rest_requests_per_minute: float
    unit_timeout_s: float


class EngineDescription(msgspec.Struct, kw_only=True):
    name: str
    sample_rate: int
    voices: list[str]
    default_voice: str
    languages: list[str]
    word_timestamps: bool
    voice_cloning: bool
    native_speed: list[float]


class EffectiveConfig(msgspec.Struct, kw_only=True):
    """The config in force after defaults are applied (echoed in `session.updated`)."""

    model: str
    voice: str
    language: str | None
    instructions: str | None
    speed: float
    response_format: AudioFormat
    sample_rate: int
    stream_audio: bool
    split_granularity: SplitGranularity
    max_buffer_delay_ms: int
    word_timestamps: bool
    audio_frames: AudioFrames
    seed: int | None
    max_new_tokens: int | None
    initial_codec_chunk_frames: int | None
    task_type: str
    """vllm-omni's task: `CustomVoice` (a predefined voice) unless the engine can clone."""


class SessionUpdated(msgspec.Struct, tag="session.updated", tag_field="type", kw_only=True):
    session_id: str
    config: EffectiveConfig
    limits: Limits
    engine: EngineDescription


class AudioStart(msgspec.Struct, tag="audio.start", tag_field="type", kw_only=True, omit_defaults=True):
    utterance_index: int
    sentence_index: int
    sentence_text: str
    format: AudioFormat
    word_timestamps: bool = False
    sample_rate: int
    channels: int
    context_id: str | None = None


class WordTiming(msgspec.Struct, kw_only=True):
    """A word's time span in milliseconds and its character span in the utterance text."""

    word: str
    start_ms: int
    end_ms: int
    char_start: int
    char_end: int


class AudioChunk(msgspec.Struct, tag="audio.chunk", tag_field="type", kw_only=True):
    """vllm-omni's JSON audio frame. Times are integer ms from the unit's first sample; with word
    timestamps a trailing chunk (empty audio, `chunk_start_ms` 0, `chunk_end_ms` the unit duration)
    carries the unit's words, timed from the unit's first sample as vllm-omni does."""

    utterance_index: int
    sentence_index: int
    chunk_id: int
    chunk_start_ms: int
    chunk_end_ms: int
    sample_rate: int
    channels: int
    audio_b64: str
    timestamps: list[WordTiming] | None = None


class AudioWords(msgspec.Struct, tag="audio.words", tag_field="type", kw_only=True):
    utterance_index: int
    sentence_index: int
    words: list[WordTiming]


class AudioDone(msgspec.Struct, tag="audio.done", tag_field="type", kw_only=True):
    """`error` is True when the unit failed or was cancelled after `audio.start` (vllm-omni's bool)."""

    utterance_index: int
    sentence_index: int
    total_bytes: int
    error: bool
    audio_ms: float


class Timings(msgspec.Struct, kw_only=True):
    first_audio_ms: float | None
    engine_ms: float


class SessionDone(msgspec.Struct, tag="session.done", tag_field="type", kw_only=True):
    utterance_index: int
    total_sentences: int
    audio_ms: float
    timings: Timings


class AudioCancelled(msgspec.Struct, tag="audio.cancelled", tag_field="type", kw_only=True,
                     omit_defaults=True):
    utterance_index: int
    audio_ms: float
    context_id: str | None = None


class ErrorEvent(msgspec.Struct, tag="error", tag_field="type", kw_only=True, omit_defaults=True):
    """vllm-omni's `{type, message}` plus our stable `code` and `fatal` (always present)."""

    message: str
    code: str
    fatal: bool
    partial_audio: bool | None = None
    action: str | None = None
    param: str | None = None
    utterance_index: int | None = None
    sentence_index: int | None = None


ServerEvent = (
    SessionUpdated | AudioStart | AudioChunk | AudioWords | AudioDone | SessionDone | AudioCancelled
    | ErrorEvent
)

_encoder: Final = msgspec.json.Encoder()


def encode_event(event: ServerEvent) -> str:
    """Render one server event as the text of a WebSocket text frame."""
    return _encoder.encode(event).decode()


def error_event(exc: ProtocolError, *, fatal: bool | None = None) -> ErrorEvent:
    return ErrorEvent(message=exc.message, code=exc.code, fatal=exc.fatal if fatal is None else fatal,
                      param=exc.param)
