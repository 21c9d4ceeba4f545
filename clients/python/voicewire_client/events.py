"""Typed server events of the voicewire WebSocket protocol, and their parser.

Every JSON event the server sends becomes one of the frozen dataclasses below (`parse_event`); binary
audio frames and the audio of vllm-omni style `audio.chunk` events become `AudioData`. Event types this
client does not know become `UnknownEvent`, so a newer server never breaks an older client, and unknown
fields are ignored, as the protocol asks of clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class WordTiming:
    """One spoken word: times in ms on the utterance timeline (0 = the utterance's first sample) and its
    character span in the utterance text (all `send_text` deltas of the utterance, concatenated)."""

    word: str
    start_ms: float
    end_ms: float
    char_start: int
    char_end: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WordTiming:
        return cls(word=str(data["word"]), start_ms=float(data["start_ms"]), end_ms=float(data["end_ms"]),
                   char_start=int(data["char_start"]), char_end=int(data["char_end"]))


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The engine behind the session, from `session.updated`."""

    name: str
    sample_rate: int
    voices: tuple[str, ...]
    default_voice: str
    word_timestamps: bool


@dataclass(frozen=True, slots=True)
class SessionUpdated:
    """A `session.config` was accepted. `config` is the effective config (defaults applied), `limits`
    the published limits (timeouts, sizes, caps), both as the server sent them."""

    session_id: str
    config: dict[str, Any]
    limits: dict[str, Any]
    engine: EngineInfo


@dataclass(frozen=True, slots=True)
class AudioStart:
    """A synthesis unit (a sentence or clause) begins; its audio and words follow, then `AudioDone`."""

    utterance_index: int
    sentence_index: int
    sentence_text: str
    format: str
    sample_rate: int
    channels: int
    context_id: str | None = None


@dataclass(frozen=True, slots=True)
class AudioData:
    """Audio bytes in the negotiated format, of the unit announced by the last `AudioStart`."""

    utterance_index: int
    sentence_index: int
    data: bytes


@dataclass(frozen=True, slots=True)
class AudioWords:
    """Word timings of a unit, on the utterance timeline; sent no later than the unit's last audio."""

    utterance_index: int
    sentence_index: int
    words: tuple[WordTiming, ...]


@dataclass(frozen=True, slots=True)
class AudioDone:
    """A unit ended. `error` is true when it failed or was cancelled after `AudioStart`."""

    utterance_index: int
    sentence_index: int
    total_bytes: int
    error: bool
    audio_ms: float


@dataclass(frozen=True, slots=True)
class SessionDone:
    """The last unit of an utterance ended after `done()`. `first_audio_ms` is the server's time from
    the text that completed the first unit to its first audio; `engine_ms` the engine's compute time."""

    utterance_index: int
    total_sentences: int
    audio_ms: float
    first_audio_ms: float | None
    engine_ms: float


@dataclass(frozen=True, slots=True)
class AudioCancelled:
    """Answers `cancel()`: no audio of this utterance follows. `audio_ms` is how much had been sent."""

    utterance_index: int
    audio_ms: float
    context_id: str | None = None


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """A server `error` event. A fatal one is followed by the server closing the socket; a non-fatal one
    leaves the session usable."""

    code: str
    message: str
    fatal: bool
    param: str | None = None
    utterance_index: int | None = None
    sentence_index: int | None = None
    partial_audio: bool | None = None


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event type this client does not know, kept whole."""

    type: str
    data: dict[str, Any] = field(default_factory=dict)


Event = (
    SessionUpdated | AudioStart | AudioData | AudioWords | AudioDone | SessionDone | AudioCancelled
    | ErrorEvent | UnknownEvent
)


def parse_event(data: dict[str, Any]) -> Event:
    """Turn one decoded JSON server event into its dataclass (`audio.chunk` is handled by the session,
    which knows the unit offsets; here it stays an `UnknownEvent`). Raises `KeyError`/`ValueError` on an
    event of a known type with a missing or malformed required field."""
    kind = str(data.get("type"))
    if kind == "session.updated":
        engine = data["engine"]
        return SessionUpdated(
            session_id=str(data["session_id"]), config=dict(data["config"]), limits=dict(data["limits"]),
            engine=EngineInfo(name=str(engine["name"]), sample_rate=int(engine["sample_rate"]),
                              voices=tuple(engine.get("voices", ())),
                              default_voice=str(engine.get("default_voice", "")),
                              word_timestamps=bool(engine.get("word_timestamps", False))))
    if kind == "audio.start":
        return AudioStart(utterance_index=int(data["utterance_index"]), sentence_index=int(data["sentence_index"]),
                          sentence_text=str(data.get("sentence_text", "")), format=str(data["format"]),
                          sample_rate=int(data["sample_rate"]), channels=int(data.get("channels", 1)),
                          context_id=data.get("context_id"))
    if kind == "audio.words":
        return AudioWords(utterance_index=int(data["utterance_index"]), sentence_index=int(data["sentence_index"]),
                          words=tuple(WordTiming.from_json(w) for w in data["words"]))
    if kind == "audio.done":
        return AudioDone(utterance_index=int(data["utterance_index"]), sentence_index=int(data["sentence_index"]),
                         total_bytes=int(data["total_bytes"]), error=bool(data["error"]),
                         audio_ms=float(data["audio_ms"]))
    if kind == "session.done":
        timings = data.get("timings") or {}
        first = timings.get("first_audio_ms")
        return SessionDone(utterance_index=int(data["utterance_index"]), total_sentences=int(data["total_sentences"]),
                           audio_ms=float(data["audio_ms"]), first_audio_ms=None if first is None else float(first),
                           engine_ms=float(timings.get("engine_ms", 0.0)))
    if kind == "audio.cancelled":
        return AudioCancelled(utterance_index=int(data["utterance_index"]), audio_ms=float(data["audio_ms"]),
                              context_id=data.get("context_id"))
    if kind == "error":
        return ErrorEvent(code=str(data.get("code", "error")), message=str(data.get("message", "")),
                          fatal=bool(data.get("fatal", False)), param=data.get("param"),
                          utterance_index=data.get("utterance_index"), sentence_index=data.get("sentence_index"),
                          partial_audio=data.get("partial_audio"))
    return UnknownEvent(type=kind, data=data)
