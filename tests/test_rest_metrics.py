"""`GET /metrics` is Prometheus text that `prometheus_client` parses, and its counters move with traffic: every
synthesis unit is counted exactly once, by how it ended."""

from __future__ import annotations

import asyncio
import gc
import time

import httpx
import websockets
from prometheus_client.parser import text_string_to_metric_families

from tests.server import ServerThread
from tests.wsclient import configure, send

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: ServerThread) -> Samples:
    """The server's samples now. The session server is shared with every other test on the loopback
    address, whose REST rate this polling also spends: a 429 is waited out as its Retry-After says
    (a few times at most), as a well-behaved scraper would."""
    for _ in range(5):
        response = httpx.get(server.http_url + "/metrics")
        if response.status_code != 429:
            break
        time.sleep(float(response.headers["Retry-After"]))
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
    assert not [name for name, _ in before if name.startswith("voicewire_codec_")], \
        "an engine without voicewire's codec path exports no codec figures"

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


def _units_total(samples: Samples) -> float:
    return sum(value(samples, "voicewire_units_total", outcome=o) for o in ("ok", "cancelled", "failed"))


def _wait_idle(server: ServerThread) -> Samples:
    """Until no session is open, no REST speech runs and the engine is idle (bounded)."""
    for _ in range(200):
        samples = scrape(server)
        if not any(value(samples, name) for name in ("voicewire_sessions_open", "voicewire_rest_speech_in_flight",
                                                     "voicewire_engine_slots_in_use", "voicewire_engine_queue_depth")):
            return samples
        time.sleep(0.1)
    raise AssertionError("the server did not go idle")


SENTENCES = " ".join(f"This is sentence number {n} of a long reading." for n in range(30))


async def test_every_unit_is_counted_once_when_a_websocket_client_vanishes(server: ServerThread) -> None:
    before = _wait_idle(server)
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
        await send(ws, {"type": "input.text", "text": SENTENCES})
        await send(ws, {"type": "input.done"})
        while not isinstance(await ws.recv(), bytes):
            pass
        ws.transport.abort()  # gone without a close frame
    after = await asyncio.to_thread(_wait_idle, server)
    assert _units_total(after) - _units_total(before) == 30
    assert value(after, "voicewire_units_total", outcome="cancelled") > value(
        before, "voicewire_units_total", outcome="cancelled")


def test_every_unit_is_counted_once_when_a_rest_client_hangs_up(server: ServerThread) -> None:
    before = _wait_idle(server)
    with httpx.stream("POST", server.http_url + "/v1/audio/speech", timeout=60,
                      json={"input": SENTENCES, "response_format": "pcm"}) as response:
        assert response.status_code == 200
        assert next(response.iter_raw())
    after = _wait_idle(server)
    assert _units_total(after) - _units_total(before) == 30
    assert value(after, "voicewire_units_total", outcome="cancelled") > value(
        before, "voicewire_units_total", outcome="cancelled")


def test_startup_heap_is_frozen_and_every_collection_is_timed() -> None:
    """Once the engine is ready the startup heap is out of the collector's reach (`gc.freeze`), and each
    collection while the server runs lands in `voicewire_gc_pause_seconds`; stopping the server stops
    the timing (its callback is removed)."""
    gc.unfreeze()
    callbacks = len(gc.callbacks)
    server = ServerThread()
    try:
        assert gc.get_freeze_count() > 0
        before = scrape(server)
        gc.collect()
        after = scrape(server)
        count = "voicewire_gc_pause_seconds_count"
        assert value(after, count, generation="2") >= value(before, count, generation="2") + 1
        assert value(after, "voicewire_gc_pause_seconds_sum", generation="2") > 0
    finally:
        server.stop()
    assert len(gc.callbacks) == callbacks


def test_full_collections_resume_soon_after_the_startup_heap_is_frozen() -> None:
    """The freeze must not leave CPython counting the frozen heap as long-lived: a full collection runs once
    the objects promoted since the last exceed a quarter of that count, so with the startup heap counted
    the first would wait for (and then scan) a quarter of it in session objects. Here the startup heap
    holds 400 000 extra objects; with low thresholds, a full collection must come within 20 000 promoted
    objects."""
    startup_heap = [[i] for i in range(400_000)]
    thresholds = gc.get_threshold()
    full: list[int] = []
    kept: list[list[int]] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(len(kept))

    server = ServerThread()
    try:
        gc.set_threshold(50, 2, 2)
        gc.callbacks.append(on_gc)
        while not full and len(kept) < 100_000:
            kept.append([len(kept)])
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)
        server.stop()
    assert len(startup_heap) == 400_000
    assert full and full[0] < 20_000, f"first full collection after {full[0] if full else 'none in'} objects"
