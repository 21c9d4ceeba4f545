"""`GET /metrics` is Prometheus text that `prometheus_client` parses, and its counters move with traffic."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server import ServerThread

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: ServerThread) -> Samples:
    response = httpx.get(server.http_url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_parse_and_move_when_speech_is_made(server: ServerThread) -> None:
    before = scrape(server)
    for family in ("voicewire_sessions_open", "voicewire_engine_queue_depth", "voicewire_engine_slots_in_use",
                   "voicewire_rest_speech_in_flight"):
        assert (family, frozenset()) in before, family

    speech = httpx.post(server.http_url + "/v1/audio/speech", timeout=60, json={
        "model": "tts-1", "voice": "alloy", "input": "Counting sheep. One more sheep.", "response_format": "pcm"})
    assert speech.status_code == 200
    refused = httpx.post(server.http_url + "/v1/audio/speech", json={"input": "Hi.", "voice": "nobody"})
    assert refused.status_code == 400

    after = scrape(server)
    seconds = len(speech.content) / 2 / 24000
    assert value(after, "voicewire_units_total", outcome="ok") - value(before, "voicewire_units_total",
                                                                       outcome="ok") == 2
    produced = value(after, "voicewire_audio_seconds_total", route="rest") - value(
        before, "voicewire_audio_seconds_total", route="rest")
    assert abs(produced - seconds) < 1e-6
    assert value(after, "voicewire_ttfa_seconds_count", route="rest") == value(
        before, "voicewire_ttfa_seconds_count", route="rest") + 1
    assert value(after, "voicewire_errors_total", code="voice_not_found") == value(
        before, "voicewire_errors_total", code="voice_not_found") + 1
    assert value(after, "voicewire_http_requests_total", route="/v1/audio/speech", status="200") == value(
        before, "voicewire_http_requests_total", route="/v1/audio/speech", status="200") + 1
    assert value(after, "voicewire_http_requests_total", route="/v1/audio/speech", status="400") == value(
        before, "voicewire_http_requests_total", route="/v1/audio/speech", status="400") + 1
    assert value(after, "voicewire_engine_busy_seconds_total") > value(before, "voicewire_engine_busy_seconds_total")
    assert value(after, "voicewire_engine_queue_depth") == 0
    assert value(after, "voicewire_rest_speech_in_flight") == 0
