"""One request vocabulary: the engine fields the WebSocket and REST share, gated by the engine's capabilities
in one place, carried to the engine as typed fields, a refusal naming the engines that can; one reading of
msgspec's validation errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest
from voicewire.adapters.registry import ENGINE_KINDS, NULL
from voicewire.protocol.engine import (
    SPEECH_FIELDS,
    EngineCapabilities,
    EngineInfo,
    EngineKind,
    SpeechParams,
    SynthesisRequest,
    conflicting_voice_source,
    unhonoured,
)
from voicewire.protocol.messages import (
    ErrorEvent,
    InputDone,
    InputText,
    ProtocolError,
    SessionConfig,
    decode_client_message,
    invalid_field,
)
from voicewire.protocol.render import render_plan, synthesis_request
from voicewire.protocol.session import Send, ServerFacts, SessionMachine, State, Synthesize, resolve_config
from voicewire.realtime.openai_errors import OpenAIError
from voicewire.realtime.speech import SpeechRequest, plan_speech

from tests.test_session_machine import FACTS

VLLM_OMNI_EXTRAS: list[tuple[str, Any]] = [
    ("extra_params", {"temperature": 0.5}),
    ("non_streaming_mode", False),
    ("ref_audio_2", "data:audio/wav;base64,AAAA"),
    ("ambient_sound", "waves on a beach"),
    ("duration_seconds", 3.5),
    ("references", [{"audio_path": "data:audio/wav;base64,AAAA", "text": "Hi."}]),
    ("speaker_embedding", [0.1, 0.2]),
    ("x_vector_only_mode", False),
]


def test_both_surfaces_share_every_engine_field_with_its_bounds() -> None:
    for surface in (SessionConfig, SpeechRequest):
        assert set(SPEECH_FIELDS) <= set(surface.__struct_fields__)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"input": "x", "initial_codec_chunk_frames": 65}, SpeechRequest)
    with pytest.raises(ProtocolError) as caught:
        decode_client_message(b'{"type": "session.config", "initial_codec_chunk_frames": 65}')
    assert (caught.value.code, caught.value.param) == ("invalid_config", "initial_codec_chunk_frames")


@pytest.mark.parametrize(("name", "value"), VLLM_OMNI_EXTRAS, ids=[case[0] for case in VLLM_OMNI_EXTRAS])
def test_a_field_the_engine_cannot_honour_is_refused_by_name_never_ignored(name: str, value: Any) -> None:
    config = msgspec.convert({name: value}, SessionConfig)
    with pytest.raises(ProtocolError) as caught:
        resolve_config(config, FACTS)
    assert (caught.value.code, caught.value.param) == ("invalid_config", name)
    assert f"{name}: not supported by engine hibari" in caught.value.message
    assert "; engines that can: omni (" in caught.value.message or caught.value.message.endswith(
        "; no engine of this build can"), caught.value.message


def test_a_refusal_names_the_engines_that_can() -> None:
    with pytest.raises(ProtocolError) as caught:
        resolve_config(SessionConfig(instructions="Calmly."), FACTS)
    assert caught.value.message == (
        "Invalid session config: instructions: not supported by engine hibari (it cannot honour it); "
        "engines that can: omni (Qwen3-TTS CustomVoice), omni (Qwen3-TTS VoiceDesign)")
    with pytest.raises(OpenAIError) as refused:
        plan_speech(SpeechRequest(input="Hi.", task_type="Base"), FACTS, max_input_chars=100)
    assert refused.value.param == "task_type"
    assert refused.value.message.endswith(
        "(it only serves task_type CustomVoice); engines that can: omni (Qwen3-TTS Base)")


def test_the_engine_capabilities_decide_and_the_engine_gets_typed_fields() -> None:
    caps = dataclasses.replace(FACTS.info.capabilities, fields=frozenset({"seed", "instructions", "extra_params"}),
                               values={"task_type": ("CustomVoice", "VoiceDesign")})
    facts = ServerFacts(info=dataclasses.replace(FACTS.info, capabilities=caps), limits=FACTS.limits,
                        model_names=FACTS.model_names, voice_aliases=FACTS.voice_aliases, languages=FACTS.languages,
                        engine_kinds=ENGINE_KINDS)
    config = SessionConfig(split_granularity="sentence", instructions="Calmly.", task_type="VoiceDesign", seed=7,
                           extra_params={"temperature": 0.5}, speed=3.0)
    m = SessionMachine(facts, "s")
    m.receive(config, 0.0)
    actions = m.receive(InputText(text="Hello there."), 1.0) + m.receive(InputDone(), 1.0)
    [unit] = [a.unit for a in actions if isinstance(a, Synthesize)]
    plan = render_plan(unit.config, facts.info)
    request = synthesis_request("r-1", unit.text, unit.config, unit.params, plan)
    assert isinstance(request, SynthesisRequest)
    assert (request.instructions, request.task_type, request.seed, request.extra_params) == (
        "Calmly.", "VoiceDesign", 7, {"temperature": 0.5})
    assert request.voice == "heart" and request.text == "Hello there."
    assert request.speed == 2.0 and plan.stretch == 1.5  # hibari's native range ends at 2.0
    assert unhonoured(SpeechParams(instructions="x", task_type="Base"), caps) == (
        "task_type", "it only serves task_type CustomVoice, VoiceDesign")


def test_empty_values_ask_for_nothing() -> None:
    caps = FACTS.info.capabilities
    assert unhonoured(SpeechParams(instructions="", extra_params={}, references=[]), caps) is None
    assert unhonoured(SpeechParams(task_type="CustomVoice", non_streaming_mode=True, seed=0, speed=4.0,
                                   language="en"), caps) is None


def test_capabilities_naming_no_request_field_are_a_bug_caught_at_construction() -> None:
    with pytest.raises(ValueError, match="seeds"):
        EngineCapabilities(word_timings=False, voice_cloning=False, speed_range=(1.0, 1.0), fields=frozenset({"seeds"}))


@pytest.mark.parametrize(("body", "param"), [
    ({"speed": "fast"}, "speed"),
    ({"speaker_embedding": [0.1, "x"]}, "speaker_embedding"),
    ({"references": [{"text": "no audio"}]}, "references"),
    ({"voice": {"name": "alloy"}}, "voice"),
    ({}, "input"),
])
def test_invalid_field_names_the_top_level_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.convert(body, SpeechRequest)
    assert invalid_field(caught.value) == (param, str(caught.value))


# -- The table: every request field on every engine -------------------------------------------------

SAMPLES: dict[str, Any] = {
    "instructions": "A calm voice.", "task_type": "VoiceDesign", "ref_audio": "data:audio/wav;base64,AAAA",
    "ref_text": "Hello.", "x_vector_only_mode": True, "speaker_embedding": [0.1, 0.2], "seed": 7,
    "max_new_tokens": 64, "initial_codec_chunk_frames": 1, "non_streaming_mode": False,
    "ref_audio_2": "data:audio/wav;base64,AAAA", "ambient_sound": "rain", "duration_seconds": 2.0,
    "references": [{"audio_path": "data:audio/wav;base64,AAAA", "text": "Hi."}],
    "extra_params": {"temperature": 0.5},
}
"""A value asking for something, per request field (`speed` and `language` are checked otherwise)."""


def engine_infos(root: Path) -> dict[str, EngineInfo]:
    """The served engines' own facts, from the real constructors (nothing is started), by the label of their
    declared `EngineKind`, in the order `ENGINE_KINDS` names them (`null` second)."""
    from voicewire.adapters.hibari import HibariEngine
    from voicewire.adapters.null import NullEngine
    from voicewire.adapters.omni import OmniConfig, OmniEngine
    from voicewire.adapters.omni_families import omni_engine
    from voicewire.adapters.omni_testing import write_fish_s2_pro, write_qwen3_tts
    from voicewire.adapters.talker import TalkerConfig, TalkerEngine
    from voicewire.adapters.talker_testing import write_snac, write_talker

    talker = TalkerEngine(TalkerConfig(talker_model=str(write_talker(root / "talker", voices={"tara": [1]})),
                                       codec_model=str(write_snac(root / "snac"))))
    infos = {"hibari": HibariEngine().info, "null": NullEngine().info, "talker": talker.info}
    for kind, task in (("custom_voice", "CustomVoice"), ("voice_design", "VoiceDesign"), ("base", "Base")):
        model = str(write_qwen3_tts(root / kind, kind))
        infos[f"omni (Qwen3-TTS {task})"] = OmniEngine(OmniConfig(model=model)).info
    infos["omni (Fish Speech S2 Pro)"] = omni_engine(OmniConfig(model=str(write_fish_s2_pro(root / "fish")))).info
    return infos


def facts_of(info: EngineInfo) -> ServerFacts:
    return ServerFacts(info=info, limits=FACTS.limits, model_names=frozenset({info.name}), voice_aliases={},
                       languages=frozenset(info.languages), engine_kinds=ENGINE_KINDS)


def honours(caps: EngineCapabilities | EngineKind, name: str, value: Any) -> bool:
    return name in caps.fields or value in caps.values.get(name, ())


def engines_that_can(infos: dict[str, EngineInfo], can: Any) -> str:
    """The end of a refusal, from the real engines (the `null` stand-in is never offered)."""
    able = [label for label, info in infos.items() if label != "null" and can(info.capabilities)]
    return f"engines that can: {', '.join(able)}" if able else "no engine of this build can"


def test_each_engine_honours_what_its_kind_declares(tmp_path: Path) -> None:
    """The static table refusals name engines from (`adapters/registry.py`) says what each real engine does."""
    infos = engine_infos(tmp_path)
    kinds = {kind.label: kind for kind in (*ENGINE_KINDS, NULL)}
    assert list(kinds) == [label for label in infos if label != "null"] + ["null"]
    for label, info in infos.items():
        caps, kind = info.capabilities, kinds[label]
        assert caps.word_timings == kind.word_timings, label
        for name, value in SAMPLES.items():
            assert honours(caps, name, value) == kind.honours(name, value), (label, name)


def test_every_field_is_sampled() -> None:
    assert set(SAMPLES) == set(SPEECH_FIELDS) - {"speed", "language"}  # a new field needs a row here


def test_no_field_is_ignored_on_any_engine(tmp_path: Path) -> None:
    """Every field on every engine: accepted only where the engine says it honours it (and then carried to
    the engine as a typed field), otherwise refused by name, naming the engine and the engines that can
    (those that accept it here), on both surfaces."""
    infos = engine_infos(tmp_path)
    timings = engines_that_can(infos, lambda other: other.word_timings)
    for engine, info in infos.items():
        caps, facts = info.capabilities, facts_of(info)
        if caps.word_timings:
            resolve_config(SessionConfig(word_timestamps=True), facts)
        else:
            with pytest.raises(ProtocolError) as no_words:
                resolve_config(SessionConfig(word_timestamps=True), facts)
            assert no_words.value.message.endswith(f"; {timings}"), (engine, no_words.value.message)
        for name, value in SAMPLES.items():
            honoured = honours(caps, name, value)
            others = engines_that_can(infos, lambda other, name=name, value=value: honours(other, name, value))
            config = msgspec.convert({name: value}, SessionConfig)
            try:
                resolve_config(config, facts)
            except ProtocolError as exc:
                assert not honoured, (engine, name, exc.message)
                assert (exc.code, exc.param) == ("invalid_config", name), (engine, name, exc.message)
                assert f"not supported by engine {info.name}" in exc.message, (engine, name, exc.message)
                assert exc.message.endswith(f"; {others}"), (engine, name, exc.message)
            else:
                assert honoured, f"{engine} accepts {name} it does not honour"
                m = SessionMachine(facts, "s")
                m.receive(msgspec.structs.replace(config, split_granularity="sentence"), 0.0)
                actions = m.receive(InputText(text="Hi."), 0.0) + m.receive(InputDone(), 0.0)
                [unit] = [a.unit for a in actions if isinstance(a, Synthesize)]
                request = synthesis_request("r", unit.text, unit.config, unit.params, render_plan(unit.config, info))
                assert getattr(request, name) == value, (engine, name)
            body = msgspec.convert({"input": "Hi.", name: value}, SpeechRequest)
            if honoured:
                assert getattr(plan_speech(body, facts, max_input_chars=100).params, name) == value
            else:
                with pytest.raises(OpenAIError) as refused:
                    plan_speech(body, facts, max_input_chars=100)
                assert (refused.value.status, refused.value.param) == (400, name), (engine, name)
                assert refused.value.message.endswith(f"; {others}"), (engine, name, refused.value.message)


def test_token_level_streaming_is_the_sessions_text_streaming_on_every_engine_and_refused_on_rest(
        tmp_path: Path) -> None:
    """vllm-omni's `streaming_mode: "token_level"` is a session field, not an engine's: on the WebSocket
    every engine gets sentence units (the first one early, at a clause) and streamed audio, and a
    granularity the config names is kept; REST, whose input is whole, refuses it by name."""
    for engine, info in engine_infos(tmp_path).items():
        facts = facts_of(info)
        config = resolve_config(SessionConfig(streaming_mode="token_level", response_format="pcm"), facts)
        assert (config.split_granularity, config.stream_audio, config.streaming_mode) == (
            "sentence", True, "token_level"), engine
        clause = resolve_config(SessionConfig(streaming_mode="token_level", split_granularity="clause"), facts)
        assert (clause.split_granularity, clause.stream_audio, clause.response_format) == ("clause", True, "wav")
        m = SessionMachine(facts, "s")
        m.receive(SessionConfig(streaming_mode="token_level", response_format="pcm"), 0.0)
        units = [a.unit.text for delta in ("Hello there, this is a token level ", "test. The rest ", "follows.")
                 for a in m.receive(InputText(text=delta), 0.0) if isinstance(a, Synthesize)]
        assert units == ["Hello there, this is a token level test."], engine  # before input.done
        body = msgspec.convert({"input": "Hi.", "streaming_mode": "token_level"}, SpeechRequest)
        with pytest.raises(OpenAIError) as refused:
            plan_speech(body, facts, max_input_chars=100)
        assert (refused.value.status, refused.value.param) == (400, "streaming_mode"), engine
        assert "WebSocket" in refused.value.message
    with pytest.raises(ProtocolError) as unknown:
        decode_client_message(b'{"type": "session.config", "streaming_mode": "word_level"}')
    assert (unknown.value.code, unknown.value.param) == ("invalid_config", "streaming_mode")
    assert "valid values: token_level" in unknown.value.message
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"input": "Hi.", "streaming_mode": "word_level"}, SpeechRequest)


# -- Voice sources: speaker_embedding is a whole voice, never combined with another ------------------

def test_speaker_embedding_clashes_with_ref_audio_and_with_an_uploaded_voice() -> None:
    embedding = SpeechParams(speaker_embedding=[0.1, 0.2])
    assert conflicting_voice_source(embedding, None) is None
    assert conflicting_voice_source(SpeechParams(ref_audio=SAMPLES["ref_audio"]), "mine") is None
    assert conflicting_voice_source(SpeechParams(speaker_embedding=[], ref_audio=SAMPLES["ref_audio"]), "m") is None
    both = SpeechParams(speaker_embedding=[0.1, 0.2], ref_audio=SAMPLES["ref_audio"])
    param, why = conflicting_voice_source(both, None) or ("", "")
    assert param == "speaker_embedding" and "ref_audio" in why
    param, why = conflicting_voice_source(embedding, "mine") or ("", "")
    assert param == "speaker_embedding" and "'mine'" in why and "uploaded voice" in why


@pytest.mark.parametrize("clash", [{"ref_audio": SAMPLES["ref_audio"]}, {"voice": "mine"}],
                         ids=["ref_audio", "uploaded voice"])
def test_a_cloning_engine_refuses_speaker_embedding_with_another_voice_source_on_both_surfaces(
        tmp_path: Path, clash: dict[str, Any]) -> None:
    """The omni Base checkpoint honours each field alone; the pair is refused by name, never resolved by a
    silent precedence: a non-fatal `invalid_config` on the WebSocket (the session keeps its config), a 400
    naming the field on REST."""
    info = engine_infos(tmp_path)["omni (Qwen3-TTS Base)"]
    facts = dataclasses.replace(facts_of(info), voice_exists=lambda name: name == "mine")
    for alone in ({"speaker_embedding": [0.1, 0.2]}, clash):
        resolve_config(msgspec.convert(alone, SessionConfig), facts)
        plan_speech(msgspec.convert({"input": "Hi.", **alone}, SpeechRequest), facts, max_input_chars=100)
    body = {"speaker_embedding": [0.1, 0.2], **clash}
    named = "ref_audio" if "ref_audio" in clash else "'mine'"

    m = SessionMachine(facts, "s")
    m.receive(SessionConfig(x_vector_only_mode=True), 0.0)
    before = m.config
    [sent] = m.receive(msgspec.convert(body, SessionConfig), 1.0)
    assert isinstance(sent, Send) and isinstance(sent.event, ErrorEvent)
    error = sent.event
    assert (error.code, error.param, error.fatal) == ("invalid_config", "speaker_embedding", False)
    assert "speaker_embedding" in error.message and named in error.message
    assert m.config is before and m.state is State.READY

    with pytest.raises(OpenAIError) as refused:
        plan_speech(msgspec.convert({"input": "Hi.", **body}, SpeechRequest), facts, max_input_chars=100)
    assert (refused.value.status, refused.value.param) == (400, "speaker_embedding")
    assert "speaker_embedding" in refused.value.message and named in refused.value.message
