"""How much audio one unit or one REST response may produce (issue 14 #3), against the real server and
engine: bounded by estimate before synthesis, and stopped if the audio runs past the bound anyway."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

SPEAK = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True}
SENTENCES = "The weather was cold and windy this morning. She opened the window to let in some fresh air. " * 2
"""Estimated at 12 s at speed 1 (spoken in about 12 s), 6 s at speed 2."""
DIGITS = "7" * 25 + "."
"""Estimated at under 2 s by its length, spoken as cardinals for far longer than 8 s."""
SPEECH = "/v1/audio/speech"


def rest_audio_seconds(server: ServerThread) -> float:
    """`voicewire_audio_seconds_total{route="rest"}` from /metrics."""
    for family in text_string_to_metric_families(httpx.get(server.http_url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "voicewire_audio_seconds_total" and sample.labels.get("route") == "rest":
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def bounded() -> Iterator[ServerThread]:
    srv = ServerThread(Settings(max_unit_audio_s=30.0, max_response_audio_s=8.0))
    yield srv
    srv.stop()


async def test_the_bounds_are_published_in_session_updated(bounded: ServerThread) -> None:
    async with websockets.connect(bounded.ws_url) as ws:
        limits = (await configure(ws, **SPEAK))["limits"]
    assert limits["max_unit_audio_s"] == 30.0 and limits["max_response_audio_s"] == 8.0


async def test_a_unit_past_its_audio_bound_is_stopped_and_the_session_goes_on(bounded: ServerThread) -> None:
    async with websockets.connect(bounded.ws_url) as ws:
        await configure(ws, **SPEAK)
        await send(ws, {"type": "input.text", "text": "Read " + "7" * 100 + ". Then stop."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
        error = got.of("error")[0]
        assert error["code"] == "unit_too_long" and not error["fatal"] and "30 s of audio" in error["message"]
        first, second = got.of("audio.done")
        assert first["error"] is True and first["audio_ms"] <= 30_000
        assert second["error"] is False and second["audio_ms"] > 0


@pytest.mark.parametrize("body", [{"response_format": "flac"}, {"response_format": "wav", "stream": False}])
def test_a_whole_response_expected_past_the_bound_is_refused_before_synthesis(bounded: ServerThread,
                                                                            body: dict[str, object]) -> None:
    before = rest_audio_seconds(bounded)
    response = httpx.post(bounded.http_url + SPEECH, json={"input": SENTENCES, **body}, timeout=120)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("audio_too_long", "input")
    assert "about 12 s of audio" in error["message"] and "stream it" in error["message"]
    assert rest_audio_seconds(bounded) == before  # refused before any synthesis


def test_the_estimate_accounts_for_speed_and_streaming_is_not_held(bounded: ServerThread) -> None:
    faster = httpx.post(bounded.http_url + SPEECH, timeout=120,
                        json={"input": SENTENCES, "response_format": "flac", "speed": 2.0})
    assert faster.status_code == 200 and len(faster.content) > 24000
    streamed = httpx.post(bounded.http_url + SPEECH, timeout=120,
                          json={"input": SENTENCES, "response_format": "pcm", "stream_format": "audio"})
    assert streamed.status_code == 200 and len(streamed.content) / 2 / 24000 > 8.0


def test_a_whole_response_whose_audio_runs_past_the_bound_is_stopped(bounded: ServerThread) -> None:
    response = httpx.post(bounded.http_url + SPEECH, json={"input": DIGITS, "response_format": "flac"}, timeout=120)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "audio_too_long"
    assert "ran long" in response.json()["error"]["message"]


def test_a_batch_shares_one_bound(bounded: ServerThread) -> None:
    half = "The weather was cold and windy this morning. Then it rained."  # about 3.9 s by estimate
    response = httpx.post(bounded.http_url + SPEECH + "/batch", timeout=120,
                          json={"items": [{"input": half}, {"input": half}, {"input": half}]})
    assert response.status_code == 400 and response.json()["error"]["code"] == "audio_too_long"
    response = httpx.post(bounded.http_url + SPEECH + "/batch", timeout=120,
                          json={"items": [{"input": half}, {"input": DIGITS}]})
    assert response.status_code == 200
    results = response.json()["results"]
    assert any(r["status"] == "error" and "ran long" in r["error"] for r in results)
    total = sum(len(base64.b64decode(r["audio_data"])) for r in results if r["status"] == "success")
    assert total / 2 / 24000 <= 8.0 + 0.1  # wav of 16-bit samples at 24 kHz, headers aside


def test_a_streamed_unit_past_its_bound_ends_the_stream_with_an_error_event(bounded: ServerThread) -> None:
    response = httpx.post(bounded.http_url + SPEECH, timeout=120,
                          json={"input": "Hello there. Read " + "7" * 100 + ".", "stream_format": "sse",
                                "response_format": "pcm"})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "speech.audio.error"
    assert events[-1]["error"]["code"] == "unit_too_long"
