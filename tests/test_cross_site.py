"""Requests a web page on another site can make through a visitor's browser, against an open (--no-auth)
development server: nothing that changes state gets through."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.test_voices import wav_bytes

EVIL = "http://evil.example"
SPEECH = "/v1/audio/speech"
VOICES = "/v1/audio/voices"


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    srv = ServerThread(Settings(voices_dir=tmp_path_factory.mktemp("voices"),
                                allowed_origins=("https://app.example",)))
    yield srv
    srv.stop()


def speech_body() -> str:
    return json.dumps({"input": "Hello there.", "voice": "alloy", "response_format": "pcm"})


def error_code(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


def test_a_cross_site_text_plain_post_cannot_synthesize(open_server: ServerThread) -> None:
    response = httpx.post(open_server.http_url + SPEECH, content=speech_body(), timeout=60,
                          headers={"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8"})
    assert response.status_code == 403 and error_code(response) == "origin_not_allowed"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_cross_site_form_cannot_upload_or_delete_a_voice(open_server: ServerThread) -> None:
    base = open_server.http_url
    response = httpx.post(base + VOICES, headers={"Origin": EVIL}, timeout=60,
                          files={"audio_sample": ("s.wav", wav_bytes(3.0), "audio/wav")},
                          data={"name": "planted", "consent": "none"})
    assert response.status_code == 403 and error_code(response) == "origin_not_allowed"
    assert "planted" not in httpx.get(base + VOICES).json()["voices"]
    assert httpx.post(base + VOICES, timeout=60, files={"audio_sample": ("s.wav", wav_bytes(3.0), "audio/wav")},
                      data={"name": "mine", "consent": "yes"}).status_code == 200
    deleted = httpx.delete(base + VOICES + "/mine", headers={"Origin": "null"})
    assert deleted.status_code == 403 and error_code(deleted) == "origin_not_allowed"
    assert "mine" in httpx.get(base + VOICES).json()["voices"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/octet-stream"])
def test_json_routes_refuse_other_body_types_even_without_an_origin(open_server: ServerThread,
                                                                    content_type: str) -> None:
    for path in (SPEECH, SPEECH + "/batch"):
        response = httpx.post(open_server.http_url + path, content=speech_body(), timeout=60,
                              headers={"Content-Type": content_type})
        assert response.status_code == 415 and error_code(response) == "unsupported_media_type", path


def test_allowed_origins_and_the_servers_own_origin_still_work(open_server: ServerThread) -> None:
    for origin in ("https://app.example", open_server.http_url, f"http://localhost:{open_server.port}"):
        response = httpx.post(open_server.http_url + SPEECH, content=speech_body(), timeout=60,
                              headers={"Origin": origin, "Content-Type": "application/json"})
        assert response.status_code == 200 and response.content, origin
    # Reads are not refused: the browser keeps another site's page from seeing the answer (no CORS).
    assert httpx.get(open_server.http_url + "/v1/models", headers={"Origin": EVIL}).status_code == 200


def test_a_json_body_without_a_content_type_is_accepted(open_server: ServerThread) -> None:
    response = httpx.post(open_server.http_url + SPEECH, content=speech_body(), timeout=60)
    assert response.status_code == 200 and response.content
