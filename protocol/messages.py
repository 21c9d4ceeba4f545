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

import math
import re
from typing import Annotated, Any, Final, Literal

import msgspec
import msgspec.inspect
from voicewire.protocol.audio import AudioFormat
from voicewire.protocol.engine import SpeechParams
from voicewire.protocol.segmenter import SplitGranularity

AudioFrames = Literal["binary", "json"]
StreamingMode = Literal["token_level"]
"""vllm-omni's `streaming_mode` values: `token_level`, text streamed into the engine as it arrives. Here it
is the session's own text streaming (`protocol.session.resolve_config`); a WebSocket field only, as in
vllm-omni (REST refuses it: a request's text is whole)."""

SAMPLE_RATE_MIN: Final = 8000
SAMPLE_RATE_MAX: Final = 48000
ECHO_CHARS: Final = 80
"""How much of a client's value an error message quotes (`echo`)."""
ERROR_MESSAGE_CHARS: Final = 1000
"""Longest error message, WebSocket or REST (`clip`); msgspec's texts quote values too."""


def clip(text: str, limit: int = ERROR_MESSAGE_CHARS) -> str:
    """`text` cut to about `limit` characters, keeping its start and its end (where msgspec names the
    field) and saying how much was left out: an error never sends a client's megabytes back."""
    if len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]}…[{len(text) - 2 * keep} characters]…{text[-keep:]}"


def echo(value: object) -> str:
    """How an error message quotes a value a client sent: its repr, clipped to `ECHO_CHARS`."""
    return clip(repr(value), ECHO_CHARS)


class ReportedError(Exception):
    """An error a client is told about, on either surface: a stable, documented `code`; a `message` for
    humans, clipped to `ERROR_MESSAGE_CHARS` (it may quote what the client sent); the request field at
    fault (`param`), if one is."""

    def __init__(self, code: str, message: str, param: str | None) -> None:
        message = clip(message)
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class ProtocolError(ReportedError):
    """A client mistake; `fatal` closes. `reason`, when set, is a finer stable code for REST's twin of the
    error (`model_not_found`, `voice_not_found`); the WebSocket sends `code` only."""

    def __init__(self, code: str, message: str, *, fatal: bool = False, param: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(code, message, param)
        self.fatal = fatal
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
    streaming_mode: StreamingMode | None = None


class InputText(msgspec.Struct, tag="input.text", tag_field="type", kw_only=True):
    text: str = ""
    context_id: str | None = None


class InputDone(msgspec.Struct, tag="input.done", tag_field="type", kw_only=True):
    context_id: str | None = None


class InputCancel(msgspec.Struct, tag="input.cancel", tag_field="type", kw_only=True):
    context_id: str | None = None


class SessionClose(msgspec.Struct, tag="session.close", tag_field="type", kw_only=True):
    pass


class SessionAck(msgspec.Struct, tag="session.ack", tag_field="type", kw_only=True):
    """The client received every server frame up to `seq` (see `protocol.resume`); the first one makes the
    session resumable."""

    seq: Annotated[int, msgspec.Meta(ge=0)]


class SessionResume(msgspec.Struct, tag="session.resume", tag_field="type", kw_only=True):
    """First message of a connection that resumes `session_id`: `token` from its `session.updated`, `seq`
    the number of the last server frame the client received."""

    session_id: str
    token: str
    seq: Annotated[int, msgspec.Meta(ge=0)]


ClientMessage = SessionConfig | InputText | InputDone | InputCancel | SessionClose | SessionAck | SessionResume
CLIENT_MESSAGE_TYPES: Final = ("session.config", "input.text", "input.done", "input.cancel", "session.close",
                               "session.ack", "session.resume")

_decoder: Final = msgspec.json.Decoder(ClientMessage)
_raw_decoder: Final = msgspec.json.Decoder(float_hook=float)
"""Untyped, to classify a refused message. With an explicit `float_hook` a number too large for a float
(1e400) decodes as inf instead of failing this decode too."""
_UNLOCATED: Final = "`$[...]`"
"""What msgspec says instead of a path when a number inside a tagged union overflows."""


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


def invalid_field(exc: msgspec.ValidationError, raw: Any = None) -> tuple[str | None, str]:
    """(param, detail) of a msgspec validation error: the top-level request field it is about (the first
    component of its path, else the missing field; None when it names neither) and msgspec's own text.
    The one reading of msgspec's messages, for the WebSocket and REST decoders alike. `raw`, the same
    input decoded untyped by a `float_hook=float` decoder, locates a number too large for a float where
    msgspec's text has no path for it (inside a tagged union)."""
    detail = str(exc)
    if _UNLOCATED in detail and raw is not None:
        detail = detail.replace(_UNLOCATED, f"`{overflow_path(raw) or '$'}`")
    match = _FIELD_AT.search(detail) or _MISSING_FIELD.search(detail)
    return (match.group(1) if match else None), detail


def valid_values(struct: type[msgspec.Struct], field: str | None) -> str:
    """`"; valid values: a, b"` when `field` of `struct` takes a fixed set of strings (a `Literal`, optional
    or not), else `""`: appended to a field error so a client sees what it may send."""
    described = msgspec.inspect.type_info(struct)
    fields = described.fields if isinstance(described, msgspec.inspect.StructType) else ()
    for info in fields:
        if info.name == field:
            kinds = info.type.types if isinstance(info.type, msgspec.inspect.UnionType) else (info.type,)
            values = [str(v) for kind in kinds if isinstance(kind, msgspec.inspect.LiteralType) for v in kind.values]
            return f"; valid values: {', '.join(values)}" if values else ""
    return ""


def _classify(data: str | bytes, exc: msgspec.ValidationError) -> ProtocolError:
    """The error a frame the typed decoder refused gets, from an untyped decode of it. That decode may still
    fail: the typed one stops at the first field of the wrong type, before any malformed JSON after it."""
    try:
        raw: Any = _raw_decoder.decode(data)
    except msgspec.DecodeError:
        return ProtocolError("invalid_json", "Invalid JSON message")
    except RecursionError:
        return ProtocolError("invalid_message", "JSON nested too deeply")
    if not isinstance(raw, dict):
        return ProtocolError("invalid_message", "WebSocket messages must be JSON objects")
    kind = raw.get("type")
    if kind not in CLIENT_MESSAGE_TYPES:
        return ProtocolError("unknown_type", f"Unknown message type: {clip(str(kind), ECHO_CHARS)}")
    field, detail = invalid_field(exc, raw)
    if kind == "session.config":
        return ProtocolError("invalid_config", f"Invalid session config: {detail}{valid_values(SessionConfig, field)}",
                             param=field)
    if kind == "input.text" and field == "text":
        return ProtocolError("invalid_text", "input.text requires a string value", param="text")
    return ProtocolError("invalid_message", f"Invalid {kind}: {detail}")


def overflow_path(value: Any) -> str | None:
    """The JSON path (`$.speed`, `$.items[2].speed`) of the first number in an untyped decode that was too
    large for a float (decoded as inf by a `float_hook=float` decoder), or None."""
    stack: list[tuple[str, Any]] = [("$", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and math.isinf(item):
            return path
        if isinstance(item, dict):
            stack.extend((f"{path}.{key}", child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{path}[{index}]", child) for index, child in reversed(list(enumerate(item))))
    return None


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
    max_unit_audio_s: float
    max_response_audio_s: float
    resume_window_s: float
    """How long a session whose connection dropped waits for `session.resume` (0: sessions never wait)."""
    replay_buffer_bytes: int
    """Server frames kept per session for a resume; a resumable session pauses its synthesis past it until
    the client acknowledges (`session.ack`) or resumes."""


class EngineDescription(msgspec.Struct, kw_only=True):
    name: str
    models: list[str]
    """What `model` may name: the engine, its model's ids (`EngineInfo.model_ids`), then the aliases."""
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
    """vllm-omni's task: as asked, else the engine's own (`CustomVoice`, `VoiceDesign` or `Base`)."""
    streaming_mode: StreamingMode | None = None
    """As asked; `token_level` shows in `split_granularity` and `stream_audio` (see `resolve_config`)."""


class SessionUpdated(msgspec.Struct, tag="session.updated", tag_field="type", kw_only=True):
    session_id: str
    config: EffectiveConfig
    limits: Limits
    engine: EngineDescription
    resume_token: str
    """Secret that lets a new connection of the same API key resume this session (`session.resume`)."""


class SessionResumed(msgspec.Struct, tag="session.resumed", tag_field="type", kw_only=True):
    """Answers a successful `session.resume`, outside the frame numbering: the frames after `seq` follow
    (`replay_frames` of them, `replay_bytes` long), then the live stream; `input_seq` client messages were
    applied, so the client resends those after it."""

    session_id: str
    seq: int
    input_seq: int
    replay_frames: int
    replay_bytes: int


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
    | ErrorEvent | SessionResumed
)

_encoder: Final = msgspec.json.Encoder()


def encode_event(event: ServerEvent) -> str:
    """Render one server event as the text of a WebSocket text frame."""
    return _encoder.encode(event).decode()


def encode_event_bytes(event: ServerEvent) -> bytes:
    """`encode_event` as UTF-8 bytes (what `protocol.resume.stamp` numbers)."""
    return _encoder.encode(event)


def error_event(exc: ProtocolError, *, fatal: bool | None = None) -> ErrorEvent:
    return ErrorEvent(message=exc.message, code=exc.code, fatal=exc.fatal if fatal is None else fatal,
                      param=exc.param)
