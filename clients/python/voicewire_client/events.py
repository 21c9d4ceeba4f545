"""Typed server events of the voicewire WebSocket protocol, and their decoder.

Every JSON event the server sends decodes, in one msgspec pass over the frame (`decode_event`), into one
of the frozen Structs below, picked by its `type` tag; binary audio frames and the audio of vllm-omni
style `audio.chunk` events become `AudioData` (the session does that: it knows which unit is open). Event
types this client does not know become `UnknownEvent`, so a newer server never breaks an older client, and
unknown fields are ignored, as the protocol asks of clients. This package is standalone: these types
mirror the wire contract (docs/protocol.md) and import nothing of the server.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec


class WordTiming(msgspec.Struct, frozen=True):
    """One spoken word: times in ms on the utterance timeline (0 = the utterance's first sample) and its
    character span in the utterance text (all `send_text` deltas of the utterance, concatenated)."""

    word: str
    start_ms: float
    end_ms: float
    char_start: int
    char_end: int


class EngineInfo(msgspec.Struct, frozen=True):
    """The engine behind the session, from `session.updated`."""

    name: str
    sample_rate: int
    voices: tuple[str, ...] = ()
    default_voice: str = ""
    word_timestamps: bool = False


class SessionUpdated(msgspec.Struct, frozen=True, tag="session.updated", tag_field="type"):
    """A `session.config` was accepted. `config` is the effective config (defaults applied), `limits`
    the published limits (timeouts, sizes, caps), both as the server sent them."""

    session_id: str
    config: dict[str, Any]
    limits: dict[str, Any]
    engine: EngineInfo
    resume_token: str | None = None
    """What resumes this session on a new connection (`Session` does it by itself); None from a server
    without resume."""


class AudioStart(msgspec.Struct, frozen=True, tag="audio.start", tag_field="type"):
    """A synthesis unit (a sentence or clause) begins; its audio and words follow, then `AudioDone`."""

    utterance_index: int
    sentence_index: int
    format: str
    sample_rate: int
    sentence_text: str = ""
    channels: int = 1
    context_id: str | None = None


class AudioData(msgspec.Struct, frozen=True):
    """Audio bytes in the negotiated format, of the unit announced by the last `AudioStart`."""

    utterance_index: int
    sentence_index: int
    data: bytes


class AudioWords(msgspec.Struct, frozen=True, tag="audio.words", tag_field="type"):
    """Word timings of a unit, on the utterance timeline; sent no later than the unit's last audio."""

    utterance_index: int
    sentence_index: int
    words: tuple[WordTiming, ...]


class AudioDone(msgspec.Struct, frozen=True, tag="audio.done", tag_field="type"):
    """A unit ended. `error` is true when it failed or was cancelled after `AudioStart`."""

    utterance_index: int
    sentence_index: int
    total_bytes: int
    error: bool
    audio_ms: float


class Timings(msgspec.Struct, frozen=True):
    """The server's timings of an utterance (`session.done.timings`)."""

    first_audio_ms: float | None = None
    engine_ms: float = 0.0


class SessionDone(msgspec.Struct, frozen=True, tag="session.done", tag_field="type"):
    """The last unit of an utterance ended after `done()`. `first_audio_ms` is the server's time from
    the text that completed the first unit to its first audio; `engine_ms` the engine's compute time."""

    utterance_index: int
    total_sentences: int
    audio_ms: float
    timings: Timings = msgspec.field(default_factory=Timings)

    @property
    def first_audio_ms(self) -> float | None:
        return self.timings.first_audio_ms

    @property
    def engine_ms(self) -> float:
        return self.timings.engine_ms


class AudioCancelled(msgspec.Struct, frozen=True, tag="audio.cancelled", tag_field="type"):
    """Answers `cancel()`: no audio of this utterance follows. `audio_ms` is how much had been sent."""

    utterance_index: int
    audio_ms: float
    context_id: str | None = None


class ErrorEvent(msgspec.Struct, frozen=True, tag="error", tag_field="type"):
    """A server `error` event. A fatal one is followed by the server closing the socket; a non-fatal one
    leaves the session usable."""

    code: str = "error"
    message: str = ""
    fatal: bool = False
    param: str | None = None
    utterance_index: int | None = None
    sentence_index: int | None = None
    partial_audio: bool | None = None


class AudioChunk(msgspec.Struct, frozen=True, tag="audio.chunk", tag_field="type"):
    """vllm-omni's JSON audio frame (`audio_frames="json"`): base64 audio and, on a unit's trailing chunk,
    its words timed from the unit's first sample. The session turns it into `AudioData`/`AudioWords`."""

    utterance_index: int
    sentence_index: int
    audio_b64: str = ""
    timestamps: tuple[WordTiming, ...] | None = None


class UnknownEvent(msgspec.Struct, frozen=True):
    """An event type this client does not know, kept whole."""

    type: str
    data: dict[str, Any] = msgspec.field(default_factory=dict)


Event = (
    SessionUpdated | AudioStart | AudioData | AudioWords | AudioDone | SessionDone | AudioCancelled
    | ErrorEvent | UnknownEvent
)

_Tagged = (
    SessionUpdated | AudioStart | AudioWords | AudioDone | SessionDone | AudioCancelled | ErrorEvent | AudioChunk
)
_TAGS: Final = frozenset({"session.updated", "audio.start", "audio.words", "audio.done", "session.done",
                          "audio.cancelled", "error", "audio.chunk"})
_decoder: Final = msgspec.json.Decoder(_Tagged)


def decode_event(frame: str | bytes) -> Event | AudioChunk:
    """Decode one JSON text frame of the server. Raises `ValueError` when it is not JSON, or when an event
    of a known type lacks a required field or has one of the wrong type."""
    try:
        return _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        return _unknown(msgspec.json.decode(frame), exc)


def parse_event(data: dict[str, Any]) -> Event:
    """`decode_event` for an already-decoded JSON object (`audio.chunk` stays an `UnknownEvent` here: the
    session, which knows the unit offsets, handles it). Raises `ValueError` as `decode_event` does."""
    try:
        event: Event | AudioChunk = msgspec.convert(data, _Tagged)
    except msgspec.ValidationError as exc:
        return _unknown(data, exc)
    return UnknownEvent(type="audio.chunk", data=data) if isinstance(event, AudioChunk) else event


def _unknown(data: Any, exc: msgspec.ValidationError) -> UnknownEvent:
    """An `UnknownEvent` for an object of a type this client does not know; re-raises `exc` otherwise."""
    kind = data.get("type") if isinstance(data, dict) else None
    if not isinstance(data, dict) or kind in _TAGS:
        raise exc
    return UnknownEvent(type=str(kind), data=data)
