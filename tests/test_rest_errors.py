"""Bad REST requests get OpenAI's error shape with the exact status, `param` and `code`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from voicewire.realtime.settings import Settings

from tests.server import ServerThread

SPEECH = "/v1/audio/speech"
OK = {"model": "tts-1", "voice": "alloy", "input": "Hello."}

BAD_SPEECH: list[tuple[str, dict[str, Any], int, str | None, str]] = [
    ("missing input", {"model": "tts-1"}, 400, "input", "invalid_value"),
    ("input not a string", {**OK, "input": 42}, 400, "input", "invalid_value"),
    ("empty input", {**OK, "input": ""}, 400, "input", "invalid_value"),
    ("nothing speakable", {**OK, "input": " ... !"}, 400, "input", "invalid_value"),
    ("input over 4096 characters", {**OK, "input": "a " * 2049}, 400, "input", "invalid_value"),
    ("speed too high", {**OK, "speed": 4.5}, 400, "speed", "invalid_value"),
    ("speed too low", {**OK, "speed": 0.1}, 400, "speed", "invalid_value"),
    ("unknown format", {**OK, "response_format": "ogg"}, 400, "response_format", "invalid_value"),
    ("unknown stream format", {**OK, "stream_format": "chunks"}, 400, "stream_format", "invalid_value"),
    ("sample rate too low", {**OK, "sample_rate": 4000}, 400, "sample_rate", "invalid_value"),
    ("unknown voice", {**OK, "voice": "nobody"}, 400, "voice", "voice_not_found"),
    ("voice object without id", {**OK, "voice": {"name": "alloy"}}, 400, "voice", "invalid_value"),
    ("unknown model", {**OK, "model": "gpt-9-tts"}, 404, "model", "model_not_found"),
    ("unsupported language", {**OK, "language": "klingon"}, 400, "language", "invalid_value"),
    ("instructions on hibari", {**OK, "instructions": "Whisper it"}, 400, "instructions", "invalid_value"),
    ("ref_audio on hibari", {**OK, "ref_audio": "data:audio/wav;base64,AAAA"}, 400, "ref_audio",
     "invalid_value"),
    ("task_type Base on hibari", {**OK, "task_type": "Base"}, 400, "task_type", "invalid_value"),
    ("max_new_tokens on hibari", {**OK, "max_new_tokens": 100}, 400, "max_new_tokens", "invalid_value"),
    ("extra_params on hibari", {**OK, "extra_params": {"temperature": 0.5}}, 400, "extra_params",
     "invalid_value"),
    *((f"{name} on hibari", {**OK, name: value}, 400, name, "invalid_value") for name, value in (
        ("non_streaming_mode", False), ("ref_audio_2", "data:audio/wav;base64,AAAA"),
        ("ambient_sound", "rain on a tin roof"), ("duration_seconds", 2.0),
        ("references", [{"audio_path": "data:audio/wav;base64,AAAA", "text": "Hi."}]),
        ("streaming_mode", "token_level"))),
    ("negative seed", {**OK, "seed": -1}, 400, "seed", "invalid_value"),
    ("streamed word timestamps", {**OK, "word_timestamps": True, "stream_format": "audio"}, 400,
     "word_timestamps", "invalid_value"),
]


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    kind = "server_error" if response.status_code >= 500 else "invalid_request_error"
    assert body["error"]["type"] == kind
    return dict(body["error"])


@pytest.mark.parametrize(("body", "status", "param", "code"), [case[1:] for case in BAD_SPEECH],
                         ids=[case[0] for case in BAD_SPEECH])
def test_bad_speech_request(server: ServerThread, body: dict[str, Any], status: int, param: str | None,
                            code: str) -> None:
    response = httpx.post(server.http_url + SPEECH, json=body)
    assert response.status_code == status
    error = error_of(response)
    assert (error["param"], error["code"]) == (param, code)


BAD_HTTP: list[tuple[str, str, str, dict[str, Any], int, str | None, str]] = [
    ("invalid json", "POST", SPEECH, {"content": b"{not json"}, 400, None, "invalid_json"),
    ("json array", "POST", SPEECH, {"json": [1, 2]}, 400, None, "invalid_value"),
    ("body over the size cap", "POST", SPEECH, {"content": b" " * (4 * 1024 * 1024 + 1)}, 413, None,
     "payload_too_large"),
    # Numbers no field can hold, and nesting past the parser's depth (issue 14 #6, #17).
    ("speed of 1e400", "POST", SPEECH, {"content": b'{"input": "Hi.", "speed": 1e400}'}, 400, "speed",
     "invalid_value"),
    ("sample rate of -1e400", "POST", SPEECH, {"content": b'{"input": "Hi.", "sample_rate": -1e400}'}, 400,
     "sample_rate", "invalid_value"),
    ("seed of 10**400", "POST", SPEECH, {"content": b'{"input": "Hi.", "seed": 1' + b"0" * 400 + b"}"}, 400,
     "seed", "invalid_value"),
    ("json nested 100k deep", "POST", SPEECH,
     {"content": b'{"input": "Hi.", "extra_params": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"}, 400, None,
     "invalid_json"),
    ("batch json nested 100k deep", "POST", "/v1/audio/speech/batch",
     {"content": b'{"items": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}, 400, None, "invalid_json"),
    ("batch with a default speed of 1e400", "POST", "/v1/audio/speech/batch",
     {"content": b'{"speed": 1e400, "items": [{"input": "Hi."}]}'}, 400, "speed", "invalid_value"),
    ("unknown route", "GET", "/v1/audio/transcriptions/nope", {}, 404, None, "not_found"),
    ("unknown route, POST", "POST", "/v1/chat/completions", {"json": {}}, 404, None, "not_found"),
    ("wrong method", "GET", SPEECH, {}, 405, None, "method_not_allowed"),
    ("unknown model", "GET", "/v1/models/whisper-1", {}, 404, "model", "model_not_found"),
    ("delete unknown voice", "DELETE", "/v1/audio/voices/ghost", {}, 404, "name", "voice_not_found"),
    ("voice upload not multipart", "POST", "/v1/audio/voices", {"json": {"name": "x"}}, 400, None,
     "invalid_content_type"),
    ("batch without items", "POST", "/v1/audio/speech/batch", {"json": {"voice": "alloy"}}, 400, "items",
     "invalid_value"),
    ("batch with empty items", "POST", "/v1/audio/speech/batch", {"json": {"items": []}}, 400, "items",
     "invalid_value"),
    ("batch over the item cap", "POST", "/v1/audio/speech/batch",
     {"json": {"items": [{"input": "Hi."}] * 33}}, 400, "items", "invalid_value"),
    ("batch asking to stream", "POST", "/v1/audio/speech/batch",
     {"json": {"stream_format": "sse", "items": [{"input": "Hi."}]}}, 400, "stream_format", "invalid_value"),
    ("batch with a bad default", "POST", "/v1/audio/speech/batch",
     {"json": {"speed": 9, "items": [{"input": "Hi."}]}}, 400, "speed", "invalid_value"),
    ("batch with an unknown model", "POST", "/v1/audio/speech/batch",
     {"json": {"model": "nope", "items": [{"input": "Hi."}]}}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "param", "code"),
                         [case[1:] for case in BAD_HTTP], ids=[case[0] for case in BAD_HTTP])
def test_bad_http_request(server: ServerThread, method: str, path: str, kwargs: dict[str, Any], status: int,
                          param: str | None, code: str) -> None:
    response = httpx.request(method, server.http_url + path, timeout=30, **kwargs)
    assert response.status_code == status
    error = error_of(response)
    assert (error["param"], error["code"]) == (param, code)


def test_routes_outside_v1_keep_plain_errors(server: ServerThread) -> None:
    assert httpx.get(server.http_url + "/nope").status_code == 404
    assert httpx.get(server.http_url + "/health").json() == {"status": "ok"}


def test_openai_sdk_raises_a_bad_request_naming_the_param_and_the_valid_voices(server: ServerThread) -> None:
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.audio.speech.create(model="tts-1", voice="nobody", input="Hello.")
    error = caught.value
    assert error.status_code == 400 and error.param == "voice" and error.code == "voice_not_found"
    for valid in ("alloy", "cedar", "heart", "verse"):
        assert valid in error.message


@pytest.fixture(scope="module")
def full_server() -> Iterator[ServerThread]:
    srv = ServerThread(Settings(max_rest_requests=0))
    yield srv
    srv.stop()


def test_a_full_server_answers_503(full_server: ServerThread) -> None:
    for path, body in ((SPEECH, OK), ("/v1/audio/speech/batch", {"items": [{"input": "Hi."}]})):
        response = httpx.post(full_server.http_url + path, json=body)
        assert response.status_code == 503
        assert error_of(response)["code"] == "server_full"


def test_a_server_that_is_not_ready_answers_503(full_server: ServerThread) -> None:
    async def begin_shutdown() -> None:
        full_server.state.shutting_down = True

    full_server.call(begin_shutdown)
    for method, path in (("POST", SPEECH), ("GET", "/v1/models"), ("GET", "/v1/audio/voices")):
        response = httpx.request(method, full_server.http_url + path, json=OK)
        assert response.status_code == 503
        assert error_of(response)["code"] == "not_ready"


@pytest.mark.parametrize(("field", "value", "valid"), [
    ("response_format", "ogg", "aac, flac, mp3, opus, pcm, wav"),
    ("stream_format", "chunks", "audio, sse"),
])
def test_an_unknown_choice_lists_the_valid_values(server: ServerThread, field: str, value: str, valid: str) -> None:
    error = error_of(httpx.post(server.http_url + SPEECH, json={**OK, field: value}))
    assert error["param"] == field and error["message"].endswith(f"; valid values: {valid}")


HUGE = "v" * (4 * 1024 * 1024 - 1024)
"""Just under the 4 MiB body cap."""


@pytest.mark.parametrize(("field", "status", "keeps"), [
    ("voice", 400, "valid voices: "),
    ("model", 404, "this server serves "),
    ("language", 400, "supported: "),
    ("response_format", 400, "at `$.response_format`"),
])
def test_an_error_quotes_only_a_clip_of_a_huge_value(server: ServerThread, field: str, status: int,
                                                     keeps: str) -> None:
    """Issue 14 #17: a 4 MiB voice name came back whole in the error."""
    from voicewire.protocol.messages import ERROR_MESSAGE_CHARS

    response = httpx.post(server.http_url + SPEECH, json={**OK, field: HUGE}, timeout=60)
    assert response.status_code == status
    error = error_of(response)
    assert error["param"] == field and keeps in error["message"]
    assert len(error["message"]) <= ERROR_MESSAGE_CHARS + 40


def test_an_unknown_model_in_the_path_is_quoted_clipped(server: ServerThread) -> None:
    response = httpx.get(server.http_url + "/v1/models/" + "m" * 6000)
    assert response.status_code == 404 and len(error_of(response)["message"]) < 200
