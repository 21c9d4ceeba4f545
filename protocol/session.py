"""The WebSocket session state machine, sans I/O.

`SessionMachine` is fed decoded client messages (and clock ticks) and returns `Action`s for the runtime to
carry out: send an event, synthesize a unit, finish or cancel an utterance, close. It owns which message
is legal when (one table, `_LEGAL`), config resolution against the engine's facts, segmentation and unit
numbering. It never touches a socket, a task or a clock of its own, so every edge case is tested in
microseconds.

Utterance lifecycle: the first `input.text` opens utterance U; `input.done` closes its input (U is then
"draining" until the runtime reports `utterance_finished(U)`); `input.cancel` cancels every open or
draining utterance (or those of one `context_id`). A new utterance may open while an earlier one drains;
its units queue behind. Text accepted but not yet fully spoken (the open utterance plus draining ones) is
capped at `max_utterance_chars`, which bounds the memory and the unit backlog one session can hold.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from voicewire.protocol.audio import STREAMABLE_FORMATS, codec_rate
from voicewire.protocol.engine import (
    EngineInfo,
    EngineKind,
    SpeechParams,
    VoiceSample,
    conflicting_voice_source,
    default_task_type,
    engines_that_can,
    speech_params,
    unhonoured,
)
from voicewire.protocol.messages import (
    ClientMessage,
    EffectiveConfig,
    EngineDescription,
    ErrorEvent,
    InputCancel,
    InputDone,
    InputText,
    Limits,
    ProtocolError,
    SessionClose,
    SessionConfig,
    SessionUpdated,
    echo,
    error_event,
)
from voicewire.protocol.segmenter import Segment, Segmenter, SplitGranularity, speakable


class State(enum.Enum):
    AWAITING_CONFIG = "awaiting_config"
    READY = "ready"
    """Configured, no utterance open (earlier ones may still be draining)."""
    UTTERANCE_OPEN = "utterance_open"
    CLOSED = "closed"

    # Members are singletons compared by identity: hash them by identity too, in C (Enum's own __hash__ is
    # Python code, run on every client message by the `_LEGAL` lookup).
    __hash__ = object.__hash__


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What the state machine needs to know about the server to resolve and validate a config: the started
    engine's `info` (its capabilities decide which request fields are honoured), and what is published
    of it in `session.updated` (`engine`, derived from `info`)."""

    info: EngineInfo
    limits: Limits
    model_names: frozenset[str]
    """Accepted as `model` besides the engine's name and `info.model_ids` (which are always accepted)."""
    voice_aliases: dict[str, str]
    languages: frozenset[str]
    engine_kinds: tuple[EngineKind, ...]
    """The speaking engines of this build and what each honours, named when a field is refused."""
    voice_exists: Callable[[str], bool] = field(default=lambda _name: False)
    """Voices beyond the engine's own (uploaded ones); they need a cloning engine."""
    cloning_engines: tuple[str, ...] = ()
    """Engines of this build that can speak uploaded voices (named in the refusal)."""
    engine: EngineDescription = field(init=False)

    def __post_init__(self) -> None:
        info, caps = self.info, self.info.capabilities
        own = list(dict.fromkeys((info.name, *info.model_ids)))
        object.__setattr__(self, "model_names", self.model_names | set(own))
        object.__setattr__(self, "engine", EngineDescription(
            name=info.name, models=[*own, *sorted(self.model_names - set(own))], sample_rate=info.sample_rate,
            voices=list(info.voices),
            default_voice=info.default_voice, languages=list(info.languages), word_timestamps=caps.word_timings,
            voice_cloning=caps.voice_cloning, native_speed=list(caps.speed_range)))


@dataclass(frozen=True, slots=True)
class Unit:
    """One synthesis request: a segment of utterance text with the config in force when committed.

    `char_start`/`char_end` index the utterance text (all `input.text` deltas of the utterance).
    `committed_ms` is the clock value of the message (or tick) that completed the unit's text: TTFA
    starts there.
    """

    utterance_index: int
    sentence_index: int
    text: str
    char_start: int
    char_end: int
    config: EffectiveConfig
    params: SpeechParams
    """The engine's request fields as the config gave them (checked against the engine's capabilities)."""
    context_id: str | None
    committed_ms: float
    reference: VoiceSample | None = None
    """`params.ref_audio` decoded (by the runtime, once per config or request), for a cloning engine."""


@dataclass(frozen=True, slots=True)
class Send:
    event: SessionUpdated | ErrorEvent


@dataclass(frozen=True, slots=True)
class Synthesize:
    unit: Unit


@dataclass(frozen=True, slots=True)
class FinishUtterance:
    """No more units will come for this utterance; send `session.done` after its last unit."""

    utterance_index: int
    total_sentences: int


@dataclass(frozen=True, slots=True)
class CancelUtterance:
    """Stop this utterance now: abort its units, send nothing more of it, then `audio.cancelled`."""

    utterance_index: int
    context_id: str | None


@dataclass(frozen=True, slots=True)
class Close:
    code: int
    reason: str


Action = Send | Synthesize | FinishUtterance | CancelUtterance | Close

CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008

_LEGAL: dict[State, frozenset[str]] = {
    State.AWAITING_CONFIG: frozenset({"session.config", "session.close"}),
    State.READY: frozenset({"session.config", "input.text", "input.done", "input.cancel", "session.close"}),
    State.UTTERANCE_OPEN: frozenset({"input.text", "input.done", "input.cancel", "session.close"}),
    State.CLOSED: frozenset(),
}
"""Which client message types each state accepts; anything else is refused by `_illegal`."""


def message_type(msg: ClientMessage) -> str:
    """The message's `type` tag ("input.text", ...)."""
    tag = type(msg).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


@dataclass(slots=True)
class _Utterance:
    index: int
    context_id: str | None
    text_chars: int = 0
    units: int = 0


class SessionMachine:
    """Legality, config, segmentation and numbering for one WebSocket session (see module doc)."""

    def __init__(self, facts: ServerFacts, session_id: str, resume_token: str = "") -> None:
        self.facts = facts
        self.session_id = session_id
        self.resume_token = resume_token
        """Echoed in every `session.updated` (see `protocol.resume`)."""
        self.state = State.AWAITING_CONFIG
        self.config: EffectiveConfig | None = None
        self.params = SpeechParams()
        self.reference: VoiceSample | None = None
        """The config's `ref_audio` decoded (`receive`'s `reference`), carried by every unit."""
        self._segmenter: Segmenter | None = None
        self._open: _Utterance | None = None
        self._draining: dict[int, _Utterance] = {}
        self._next_utterance = 0

    # -- inputs ---------------------------------------------------------------------------------

    def receive(self, msg: ClientMessage, now_ms: float, *, reference: VoiceSample | None = None) -> list[Action]:
        """Apply one decoded client message. Raises nothing: refusals become `error` actions.

        `reference`: a `SessionConfig`'s `ref_audio`, decoded by the runtime before the message comes here
        (this machine does no I/O; audio that does not decode is refused there, naming `ref_audio`)."""
        kind = message_type(msg)
        if kind not in _LEGAL[self.state]:
            return self._illegal(kind)
        try:
            match msg:
                case SessionConfig():
                    return self._configure(msg, reference)
                case InputText():
                    return self._text(msg, now_ms)
                case InputDone():
                    return self._done(msg.context_id, now_ms)
                case InputCancel():
                    return self._cancel(msg.context_id)
                case SessionClose():
                    self.state = State.CLOSED
                    return [Close(CLOSE_NORMAL, "session.close")]
        except ProtocolError as exc:
            return self.protocol_error(exc)
        raise AssertionError(kind)

    def legal(self, msg: ClientMessage) -> bool:
        """Whether `msg` may come now (`receive` refuses it otherwise, whatever it holds)."""
        return message_type(msg) in _LEGAL[self.state]

    def protocol_error(self, exc: ProtocolError) -> list[Action]:
        """Turn a client mistake into actions; before the first config every mistake is fatal."""
        fatal = exc.fatal or self.state is State.AWAITING_CONFIG
        actions: list[Action] = [Send(error_event(exc, fatal=fatal))]
        if fatal:
            actions.extend(self._cancel(None))
            self.state = State.CLOSED
            actions.append(Close(CLOSE_POLICY, exc.code))
        return actions

    def tick(self, now_ms: float) -> list[Action]:
        """Clock: commit text that waited past `max_buffer_delay_ms`."""
        if self._segmenter is None or self._open is None:
            return []
        return self._units(self._segmenter.poll(now_ms), now_ms)

    def next_deadline_ms(self) -> float | None:
        """When `tick` has work to do, or None."""
        if self._segmenter is None or self._open is None:
            return None
        return self._segmenter.next_deadline_ms()

    def utterance_finished(self, utterance_index: int) -> None:
        """The runtime sent `session.done` (or `audio.cancelled`) for this utterance."""
        self._draining.pop(utterance_index, None)

    @property
    def active_utterances(self) -> tuple[int, ...]:
        open_ = () if self._open is None else (self._open.index,)
        return (*self._draining, *open_)

    # -- handlers -------------------------------------------------------------------------------

    def _illegal(self, kind: str) -> list[Action]:
        if self.state is State.AWAITING_CONFIG:
            return self.protocol_error(ProtocolError("config_required", f"Expected session.config, got: {kind}"))
        if self.state is State.UTTERANCE_OPEN and kind == "session.config":
            return self.protocol_error(ProtocolError(
                "reconfig_during_utterance",
                "session.config cannot be applied while an utterance is in progress; send input.done first"))
        assert self.state is State.CLOSED, (self.state, kind)
        return []

    def _configure(self, msg: SessionConfig, reference: VoiceSample | None) -> list[Action]:
        self.config = resolve_config(msg, self.facts)
        self.params = speech_params(msg)
        self.reference = reference
        self._segmenter = Segmenter(
            self.config.split_granularity,
            max_buffer_delay_ms=self.config.max_buffer_delay_ms,
            max_unit_chars=self.facts.limits.max_unit_chars,
        )
        self.state = State.READY
        return [Send(SessionUpdated(session_id=self.session_id, config=self.config,
                                    limits=self.facts.limits, engine=self.facts.engine,
                                    resume_token=self.resume_token))]

    def _text(self, msg: InputText, now_ms: float) -> list[Action]:
        assert self._segmenter is not None
        utt = self._open
        if utt is None:
            utt = self._open = _Utterance(self._next_utterance, msg.context_id)
            self._next_utterance += 1
            self._segmenter.reset()
            self.state = State.UTTERANCE_OPEN
        elif msg.context_id is not None and msg.context_id != utt.context_id:
            raise ProtocolError(
                "context_mismatch",
                f"input.text for context {echo(msg.context_id)} while context {echo(utt.context_id)} is open; "
                "send input.done or input.cancel for it first")
        limit = self.facts.limits.max_utterance_chars
        waiting = utt.text_chars
        if self._draining:
            waiting += sum(u.text_chars for u in self._draining.values())
        if waiting + len(msg.text) > limit:
            raise ProtocolError(
                "utterance_too_large",
                f"Text not yet spoken would exceed {limit} characters; this input.text was dropped. Send "
                "input.done to speak what was received, or wait for session.done before sending more.")
        utt.text_chars += len(msg.text)
        return self._units(self._segmenter.push(msg.text, now_ms), now_ms)

    def _done(self, context_id: str | None, now_ms: float) -> list[Action]:
        assert self._segmenter is not None
        utt = self._open
        if utt is None:
            utt = _Utterance(self._next_utterance, context_id)
            self._next_utterance += 1
            actions: list[Action] = []
        elif context_id is not None and context_id != utt.context_id:
            raise ProtocolError(
                "context_mismatch",
                f"input.done for context {echo(context_id)} while context {echo(utt.context_id)} is open")
        else:
            actions = self._units(self._segmenter.flush(), now_ms)
        self._open = None
        self.state = State.READY
        self._draining[utt.index] = utt
        actions.append(FinishUtterance(utt.index, utt.units))
        return actions

    def _cancel(self, context_id: str | None) -> list[Action]:
        actions: list[Action] = []
        if self._open is not None and context_id in (None, self._open.context_id):
            self._draining[self._open.index] = self._open
            self._open = None
            self.state = State.READY
        for index, utt in list(self._draining.items()):
            if context_id is None or utt.context_id == context_id:
                del self._draining[index]
                actions.append(CancelUtterance(index, utt.context_id))
        return actions

    def _units(self, segments: list[Segment], now_ms: float) -> list[Action]:
        utt = self._open
        assert utt is not None and self.config is not None
        actions: list[Action] = []
        for seg in segments:
            if not speakable(seg.text):
                continue
            text = seg.text.strip()
            start = seg.start + seg.text.index(text[0])
            actions.append(Synthesize(Unit(
                utterance_index=utt.index, sentence_index=utt.units, text=text,
                char_start=start, char_end=start + len(text), config=self.config, params=self.params,
                context_id=utt.context_id, committed_ms=now_ms, reference=self.reference)))
            utt.units += 1
        return actions


TOKEN_LEVEL_SPLIT: Final[SplitGranularity] = "sentence"
"""The units of vllm-omni's `streaming_mode: "token_level"` when the config asks for none.

vllm-omni's token-level mode starts one engine request once some text has come and feeds it the rest as
it arrives, so audio starts before the text ends. No engine here takes a growing text, so the session
streams text into units instead: `sentence` units, the first of which goes at its first comma once it has
three words (the segmenter's fast first unit), so the first audio waits for a clause, not for
`input.done`; each later unit is a whole sentence, which keeps its prosody whole. Audio is streamed as it
is synthesized (`stream_audio`), as vllm-omni streams it in that mode. A config that names
`split_granularity` `sentence` or `clause` keeps it."""


def resolve_config(msg: SessionConfig, facts: ServerFacts) -> EffectiveConfig:
    """Apply defaults and check every field against what the engine can honour.

    Raises `ProtocolError("invalid_config", ...)` naming the field; never ignores a field silently: the
    engine's request fields are checked against its capabilities by `engine.unhonoured`, and the voice
    sources against each other by `engine.conflicting_voice_source`, the one place that decides for the
    WebSocket and REST alike. The accepted engine fields are `speech_params(msg)`.
    """
    engine = facts.engine
    model = msg.model if msg.model is not None else engine.name
    if model not in facts.model_names:
        raise _bad("model", f"unknown model {echo(model)}; this server serves {', '.join(engine.models)}",
                   reason="model_not_found")
    requested = msg.voice if msg.voice is not None else msg.speaker
    voice = resolve_voice(requested, facts)
    language = msg.language
    if language is not None and language.lower() not in facts.languages:
        raise _bad("language", f"language {echo(language)} is not supported by engine {engine.name}; "
                   f"supported: {', '.join(sorted(facts.languages))}")
    refused = unhonoured(msg, facts.info.capabilities)
    if refused is not None:
        name, why = refused
        value = getattr(msg, name)
        raise _unsupported(name, why, engine.name,
                           engines_that_can(facts.engine_kinds, lambda kind: kind.honours(name, value)))
    clash = conflicting_voice_source(msg, None if voice in engine.voices else voice)
    if clash is not None:
        raise _bad(*clash)
    split, stream_audio = msg.split_granularity, msg.stream_audio
    if msg.streaming_mode == "token_level":
        if msg.response_format not in STREAMABLE_FORMATS:
            raise _bad("streaming_mode", f"token_level streams audio as it is synthesized, which needs "
                       f"response_format one of {', '.join(sorted(STREAMABLE_FORMATS))}, not {msg.response_format!r}")
        split, stream_audio = TOKEN_LEVEL_SPLIT if split == "none" else split, True
    if stream_audio and msg.response_format not in STREAMABLE_FORMATS:
        raise _bad("response_format", f"stream_audio=true needs one of {', '.join(sorted(STREAMABLE_FORMATS))}; "
                   f"{msg.response_format!r} can only be sent as one whole file per sentence")
    audio_frames = msg.audio_frames or ("json" if msg.word_timestamps else "binary")
    if msg.word_timestamps and not engine.word_timestamps:
        raise _unsupported("word_timestamps", "it has no word timings", engine.name,
                           engines_that_can(facts.engine_kinds, lambda kind: kind.word_timings))
    return EffectiveConfig(
        model=model, voice=voice, language=language, instructions=msg.instructions, speed=msg.speed,
        response_format=msg.response_format,
        sample_rate=codec_rate(msg.response_format, msg.sample_rate or engine.sample_rate),
        stream_audio=stream_audio, split_granularity=split,
        max_buffer_delay_ms=msg.max_buffer_delay_ms, word_timestamps=msg.word_timestamps,
        audio_frames=audio_frames, seed=msg.seed, max_new_tokens=msg.max_new_tokens,
        initial_codec_chunk_frames=msg.initial_codec_chunk_frames,
        task_type=msg.task_type or default_task_type(facts.info.capabilities), streaming_mode=msg.streaming_mode,
    )


def resolve_voice(requested: str | None, facts: ServerFacts) -> str:
    """Map a requested voice (engine name, alias or uploaded name) to an engine voice, or raise."""
    engine = facts.engine
    if requested is None:
        return engine.default_voice
    if requested in engine.voices:
        return requested
    alias = facts.voice_aliases.get(requested.lower())
    if alias is not None:
        return alias
    if facts.voice_exists(requested):
        if not engine.voice_cloning:
            can = ", ".join(facts.cloning_engines) or "none in this build"
            raise _bad("voice", f"voice {echo(requested)} is an uploaded voice, and engine {engine.name} cannot "
                       f"clone voices (engines that can: {can}); use one of its voices: {', '.join(engine.voices)}")
        return requested
    valid = sorted({*engine.voices, *facts.voice_aliases})
    raise _bad("voice", f"unknown voice {echo(requested)}; valid voices: {', '.join(valid)}",
               reason="voice_not_found")


def _bad(param: str, detail: str, *, reason: str | None = None) -> ProtocolError:
    return ProtocolError("invalid_config", f"Invalid session config: {param}: {detail}", param=param,
                         reason=reason)


def _unsupported(param: str, why: str, engine: str, others: str) -> ProtocolError:
    """`param` refused, saying why and which engines would honour it (`engines_that_can`)."""
    return _bad(param, f"not supported by engine {engine} ({why}); {others}")
