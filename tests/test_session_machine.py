"""The sans-I/O session state machine: legality table, numbering, cancel, config resolution."""

from __future__ import annotations

import numpy as np
import pytest
from voicewire.adapters.registry import ENGINE_KINDS
from voicewire.protocol.engine import EngineCapabilities, EngineInfo, VoiceSample
from voicewire.protocol.messages import (
    InputCancel,
    InputDone,
    InputText,
    Limits,
    SessionClose,
    SessionConfig,
    SessionUpdated,
    decode_client_message,
)
from voicewire.protocol.session import (
    CancelUtterance,
    Close,
    FinishUtterance,
    Send,
    ServerFacts,
    SessionMachine,
    State,
    Synthesize,
)

FACTS = ServerFacts(
    info=EngineInfo(name="hibari", sample_rate=24000, voices=("heart",), default_voice="heart", languages=("en",),
                    capabilities=EngineCapabilities(word_timings=True, voice_cloning=False, speed_range=(0.5, 2.0),
                                                    fields=frozenset({"seed"})),
                    max_concurrency=1),
    limits=Limits(config_timeout_s=10, idle_timeout_s=30, stall_timeout_s=15, max_message_bytes=1024,
                  max_config_bytes=4096, max_utterance_chars=100, max_unit_chars=250, max_units_in_flight=2,
                  max_sessions=4, max_sessions_per_key=4, max_sessions_per_ip=4,
                  rest_requests_per_minute=600, unit_timeout_s=60, max_unit_audio_s=120,
                  max_response_audio_s=300, resume_window_s=30, replay_buffer_bytes=1 << 20),
    model_names=frozenset({"hibari", "tts-1"}),
    voice_aliases={"alloy": "heart"},
    languages=frozenset({"en", "english", "auto"}),
    engine_kinds=ENGINE_KINDS,
    voice_exists=lambda name: name == "uploaded",
)


def machine(**config: object) -> SessionMachine:
    m = SessionMachine(FACTS, "s")
    actions = m.receive(SessionConfig(split_granularity="sentence", **config), 0.0)  # type: ignore[arg-type]
    assert isinstance(actions[0], Send) and isinstance(actions[0].event, SessionUpdated)
    return m


def units(actions: list[object]) -> list[tuple[int, int, str, int, int]]:
    return [(a.unit.utterance_index, a.unit.sentence_index, a.unit.text, a.unit.char_start, a.unit.char_end)
            for a in actions if isinstance(a, Synthesize)]


def test_units_are_numbered_per_utterance_with_offsets_into_the_utterance_text() -> None:
    m = machine()
    acts = m.receive(InputText(text="One two three. Four"), 0.0)
    acts += m.receive(InputText(text=" five six!  Seven"), 1.0)
    acts += m.receive(InputDone(), 2.0)
    assert units(acts) == [(0, 0, "One two three.", 0, 14), (0, 1, "Four five six!", 15, 29),
                           (0, 2, "Seven", 31, 36)]
    assert acts[-1] == FinishUtterance(0, 3)
    acts = m.receive(InputText(text="Again."), 3.0) + m.receive(InputDone(), 4.0)
    assert units(acts) == [(1, 0, "Again.", 0, 6)]


def test_the_legality_table() -> None:
    m = SessionMachine(FACTS, "s")
    assert m.state is State.AWAITING_CONFIG
    [send, close] = m.receive(InputText(text="hi"), 0.0)
    assert isinstance(send, Send) and send.event.fatal and isinstance(close, Close) and close.code == 1008
    assert m.state is State.CLOSED

    m = machine()
    assert m.state is State.READY
    m.receive(InputText(text="Open"), 0.0)
    assert m.state is State.UTTERANCE_OPEN
    [refusal] = m.receive(SessionConfig(response_format="pcm"), 0.0)
    assert isinstance(refusal, Send) and refusal.event.code == "reconfig_during_utterance"
    assert not refusal.event.fatal and m.config is not None and m.config.response_format == "wav"
    m.receive(InputDone(), 0.0)
    assert m.state is State.READY and m.active_utterances == (0,)
    m.receive(SessionConfig(response_format="pcm"), 0.0)
    assert m.config.response_format == "pcm"
    assert m.receive(SessionClose(), 0.0) == [Close(1000, "session.close")]


def test_cancel_covers_open_and_draining_utterances_and_respects_context_ids() -> None:
    m = machine()
    m.receive(InputText(text="First.", context_id="a"), 0.0)
    m.receive(InputDone(), 0.0)
    m.receive(InputText(text="Second", context_id="b"), 0.0)
    assert m.receive(InputCancel(context_id="b"), 0.0) == [CancelUtterance(1, "b")]
    assert m.state is State.READY and m.active_utterances == (0,)
    assert m.receive(InputCancel(), 0.0) == [CancelUtterance(0, "a")]
    assert m.active_utterances == ()
    assert m.receive(InputCancel(), 0.0) == []


def test_text_for_another_context_while_one_is_open_is_refused() -> None:
    m = machine()
    m.receive(InputText(text="Hello", context_id="a"), 0.0)
    [refusal] = m.receive(InputText(text="Other", context_id="b"), 0.0)
    assert isinstance(refusal, Send) and refusal.event.code == "context_mismatch"


def test_utterance_size_cap_drops_the_delta_but_keeps_the_session() -> None:
    m = machine()
    m.receive(InputText(text="a" * 90), 0.0)
    [refusal] = m.receive(InputText(text="b" * 20), 0.0)
    assert isinstance(refusal, Send) and refusal.event.code == "utterance_too_large"
    acts = m.receive(InputDone(), 0.0)
    assert units(acts)[0][2] == "a" * 90


@pytest.mark.parametrize(("config", "param"), [
    ({"voice": "nobody"}, "voice"),
    ({"voice": "uploaded"}, "voice"),
    ({"model": "gpt-9"}, "model"),
    ({"language": "fr"}, "language"),
    ({"instructions": "sing"}, "instructions"),
    ({"ref_audio": "x"}, "ref_audio"),
    ({"task_type": "VoiceDesign"}, "task_type"),
    ({"max_new_tokens": 5}, "max_new_tokens"),
    ({"stream_audio": True, "response_format": "flac"}, "response_format"),
])
def test_config_fields_the_engine_cannot_honour_are_refused_by_name(config: dict[str, object], param: str) -> None:
    m = machine()
    [refusal] = m.receive(SessionConfig(**config), 0.0)  # type: ignore[arg-type]
    assert isinstance(refusal, Send) and refusal.event.code == "invalid_config" and refusal.event.param == param


def test_config_defaults_and_aliases() -> None:
    m = machine(voice="ALLOY", language="English")
    assert m.config is not None
    assert m.config.voice == "heart" and m.config.sample_rate == 24000 and m.config.audio_frames == "binary"
    m.receive(SessionConfig(word_timestamps=True), 0.0)
    assert m.config.audio_frames == "json" and m.config.split_granularity == "none"


def test_decoder_reports_the_offending_config_field() -> None:
    with pytest.raises(Exception) as info:
        decode_client_message(b'{"type": "session.config", "speed": 10}')
    assert getattr(info.value, "param", None) == "speed"


def test_buffer_delay_commits_waiting_text_on_tick() -> None:
    m = machine(max_buffer_delay_ms=500)
    assert units(m.receive(InputText(text="waiting for more text "), 1000.0)) == []
    assert m.next_deadline_ms() == 1500.0
    assert units(m.tick(1499.0)) == []
    assert units(m.tick(1500.0)) == [(0, 0, "waiting for more text", 0, 21)]


def test_input_done_for_another_context_is_refused() -> None:
    m = machine()
    m.receive(InputText(text="Hello", context_id="a"), 0.0)
    [refusal] = m.receive(InputDone(context_id="b"), 0.0)
    assert isinstance(refusal, Send) and refusal.event.code == "context_mismatch"
    assert m.state is State.UTTERANCE_OPEN


def test_text_waiting_in_draining_utterances_counts_against_the_cap() -> None:
    m = machine()
    m.receive(InputText(text="a" * 60), 0.0)
    m.receive(InputDone(), 0.0)
    [refusal] = m.receive(InputText(text="b" * 50), 0.0)
    assert isinstance(refusal, Send) and refusal.event.code == "utterance_too_large"
    m.utterance_finished(0)
    assert units(m.receive(InputText(text="b" * 50), 0.0) + m.receive(InputDone(), 0.0))


def test_units_carry_the_reference_decoded_with_their_config_until_the_next_config() -> None:
    """The runtime decodes a config's `ref_audio` once; every unit of that config carries the result, and a
    later config replaces it (one without a reference clears it)."""
    m = SessionMachine(FACTS, "s")
    reference = VoiceSample.of(np.zeros(24000, np.float32), 24000)
    assert m.legal(SessionConfig()) and not m.legal(InputText(text="hi"))
    m.receive(SessionConfig(split_granularity="sentence"), 0.0, reference=reference)
    acts = m.receive(InputText(text="One. Two."), 0.0) + m.receive(InputDone(), 1.0)
    assert [a.unit.reference for a in acts if isinstance(a, Synthesize)] == [reference, reference]
    m.receive(InputText(text="Open"), 1.5)
    assert not m.legal(SessionConfig())
    m.receive(InputCancel(), 1.6)
    m.receive(SessionConfig(split_granularity="sentence"), 2.0)
    acts = m.receive(InputText(text="Three."), 2.0) + m.receive(InputDone(), 3.0)
    assert [a.unit.reference for a in acts if isinstance(a, Synthesize)] == [None]
