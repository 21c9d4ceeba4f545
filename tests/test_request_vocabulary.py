"""One request vocabulary: the engine fields the WebSocket and REST share, gated by the engine's capabilities
in one place, carried to the engine as typed fields; one reading of msgspec's validation errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
from voicewire.protocol.engine import (
    SPEECH_FIELDS,
    EngineCapabilities,
    SpeechParams,
    SynthesisRequest,
    unhonoured,
)
from voicewire.protocol.messages import (
    InputDone,
    InputText,
    ProtocolError,
    SessionConfig,
    decode_client_message,
    invalid_field,
)
from voicewire.protocol.render import render_plan, synthesis_request
from voicewire.protocol.session import ServerFacts, SessionMachine, Synthesize, resolve_config
from voicewire.realtime.speech import SpeechRequest

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


def test_the_engine_capabilities_decide_and_the_engine_gets_typed_fields() -> None:
    caps = dataclasses.replace(FACTS.info.capabilities, fields=frozenset({"seed", "instructions", "extra_params"}),
                               values={"task_type": ("CustomVoice", "VoiceDesign")})
    facts = ServerFacts(info=dataclasses.replace(FACTS.info, capabilities=caps), limits=FACTS.limits,
                        model_names=FACTS.model_names, voice_aliases=FACTS.voice_aliases, languages=FACTS.languages)
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
