"""Numbers no field can hold (1e400 overflows a float; 10**400 any fixed-size int), in every field of every
client message and REST body (issue 14 #6): always the field's own typed refusal, never a crash.

Pure: the real decoders, `resolve_config` and `plan_speech`, in microseconds per example. The socket-level
rows are in tests/test_ws_bad_input.py and tests/test_rest_errors.py.
"""

from __future__ import annotations

import json
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from voicewire.protocol.messages import (
    ClientMessage,
    ProtocolError,
    SessionConfig,
    SessionUpdated,
    decode_client_message,
    encode_event,
)
from voicewire.protocol.session import resolve_config
from voicewire.realtime.openai_errors import OpenAIError
from voicewire.realtime.speech import (
    SpeechRequest,
    convert_speech_request,
    decode_json,
    decode_speech_request,
    plan_speech,
)

from tests.test_session_machine import FACTS

EXTREME = ["1e400", "-1e400", "1e308", "-1e-400", "4.9e-324", "1" + "0" * 400, "-" + "9" * 400,
           str(2**63), str(2**64), str(-(2**63) - 1), "0", "-1", "0.0", "1.5"]
"""JSON number literals: overflowing floats and ints, the edges of float64 and int64, and plain ones."""

numbers = st.sampled_from(EXTREME)
shapes = st.sampled_from(["{}", "[{}]", '{{"a": {}}}', "[1, {}]"])
WS_FIELDS = {str(cls.__struct_config__.tag): [*cls.__struct_fields__, "extra"]
             for cls in typing.get_args(ClientMessage)}
REST_FIELDS = [*SpeechRequest.__struct_fields__, "extra"]


def literal(shape: str, number: str) -> str:
    return shape.format(number)


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(sorted(WS_FIELDS)), data=st.data(), number=numbers, shape=shapes)
def test_a_ws_message_with_an_extreme_number_anywhere_is_a_typed_error_or_accepted(
        kind: str, data: st.DataObject, number: str, shape: str) -> None:
    field = data.draw(st.sampled_from(WS_FIELDS[kind]))
    frame = f'{{"type": {json.dumps(kind)}, {json.dumps(field)}: {literal(shape, number)}}}'
    try:
        message = decode_client_message(frame)
    except ProtocolError as exc:
        assert exc.code in {"invalid_config", "invalid_text", "invalid_message"}
        if exc.code == "invalid_config":
            assert exc.param == field and "$[...]" not in exc.message
        return
    if isinstance(message, SessionConfig):
        try:
            config = resolve_config(message, FACTS)
        except ProtocolError as exc:
            assert exc.code == "invalid_config" and exc.param
            return
        encode_event(SessionUpdated(session_id="s", config=config, limits=FACTS.limits, engine=FACTS.engine,
                                    resume_token="t"))


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(REST_FIELDS), number=numbers, shape=shapes, batch=st.booleans())
def test_a_rest_body_with_an_extreme_number_anywhere_is_a_4xx_naming_the_field_or_accepted(
        field: str, number: str, shape: str, batch: bool) -> None:
    base = '{"input": "Hello."' if field != "input" else "{"
    body = f'{base}{", " if field != "input" else ""}{json.dumps(field)}: {literal(shape, number)}}}'.encode()
    try:
        if batch:
            raw = decode_json(body)
            assert isinstance(raw, dict)
            request = convert_speech_request(raw)
        else:
            request = decode_speech_request(body)
        plan_speech(request, FACTS, max_input_chars=4096)
    except OpenAIError as exc:
        assert 400 <= exc.status < 500
        assert exc.param in (field, None) and "$[...]" not in exc.message
        if exc.param is None:
            assert field in {"extra", "extra_params"} or exc.code == "invalid_json", exc.message


@pytest.mark.parametrize("field", ["speed", "sample_rate", "max_buffer_delay_ms", "seed", "max_new_tokens",
                                   "initial_codec_chunk_frames", "speaker_embedding", "voice"])
def test_1e400_in_a_config_field_names_that_field(field: str) -> None:
    """msgspec reports an overflowing float inside a tagged union at `$[...]`; we find the field."""
    value = "[1e400]" if field == "speaker_embedding" else "1e400"
    with pytest.raises(ProtocolError) as caught:
        decode_client_message(f'{{"type": "session.config", "{field}": {value}}}')
    assert caught.value.code == "invalid_config" and caught.value.param == field
    assert f"at `$.{field}" in caught.value.message


def test_the_untyped_batch_decoder_reads_an_overflowing_float_as_infinity() -> None:
    assert decode_json(b'{"speed": 1e400}') == {"speed": float("inf")}
    with pytest.raises(OpenAIError) as caught:
        convert_speech_request(decode_json(b'{"input": "Hi.", "speed": -1e400}'))
    assert caught.value.param == "speed"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b"1e400")  # what the batch route used before: a whole-body "invalid JSON"
