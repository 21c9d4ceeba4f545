"""Prometheus metrics of one server (one registry per app, so tests never share counters)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from voicewire.adapters.talker_codec import CodecBatcher
from voicewire.adapters.workers import PoolHealth

TTFA_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
GC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
T = TypeVar("T")


class Metrics:
    """The server's counters; `render()` gives the Prometheus text exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_open = Gauge("voicewire_sessions_open", "WebSocket sessions open now", registry=r)
        self.sessions_total = Counter("voicewire_sessions", "WebSocket sessions accepted", registry=r)
        self.sessions_refused = Counter("voicewire_sessions_refused", "WebSocket sessions refused, by reason: "
                                        "full (max_sessions), capacity (admission), limit (per key or address)",
                                        ["reason"], registry=r)
        self.units = Counter("voicewire_units", "Synthesis units by outcome", ["outcome"], registry=r)
        self.ttfa = Histogram("voicewire_ttfa_seconds",
                              "Time from the text completing an utterance's first unit to its first audio sent",
                              ["route"], buckets=TTFA_BUCKETS, registry=r)
        self.audio_seconds = Counter("voicewire_audio_seconds", "Seconds of audio produced", ["route"], registry=r)
        self.engine_busy = Counter("voicewire_engine_busy_seconds", "Engine slot time in use", registry=r)
        self.engine_audio = Counter("voicewire_engine_audio_seconds",
                                    "Seconds of audio the engine produced, counted with the slot time it took",
                                    registry=r)
        self.engine_speed = Gauge("voicewire_engine_speed",
                                  "Measured audio seconds per engine-slot second (0 until measured)", registry=r)
        self.capacity_streams = Gauge("voicewire_capacity_streams",
                                      "Real-time streams admission fills: admission_utilization x slots x speed",
                                      registry=r)
        self.speaking_streams = Gauge("voicewire_speaking_streams",
                                      "Sessions speaking now plus REST speech requests in progress", registry=r)
        self.engine_queue = Gauge("voicewire_engine_queue_depth", "Units waiting for an engine slot", registry=r)
        self.engine_in_use = Gauge("voicewire_engine_slots_in_use", "Engine slots computing now", registry=r)
        self.errors = Counter("voicewire_errors", "Errors sent to clients by code", ["code"], registry=r)
        self.requests = Counter("voicewire_http_requests", "REST requests by route and status",
                                ["route", "status"], registry=r)
        self.rest_in_flight = Gauge("voicewire_rest_speech_in_flight", "REST speech requests synthesizing now",
                                    registry=r)
        self.key_reload_failures = Counter("voicewire_api_key_reload_failures",
                                           "Reads of the API key file that failed (the last good keys stay)",
                                           registry=r)
        self.keys_stale = Gauge("voicewire_api_keys_stale",
                                "1 while the API key file cannot be read and the last good keys are in force",
                                registry=r)
        self.sessions_revoked = Counter("voicewire_sessions_revoked",
                                        "WebSocket sessions closed because their API key was revoked", registry=r)
        self.resumes_attempted = Counter("voicewire_resumes_attempted",
                                         "Connections opened to resume a session (?session_id=)", registry=r)
        self.resumes_succeeded = Counter("voicewire_resumes_succeeded", "Sessions resumed on a new connection",
                                         registry=r)
        self.resumes_expired = Counter("voicewire_resumes_expired",
                                       "Sessions that waited resume_window_s for a resume that never came",
                                       registry=r)
        self.replayed_bytes = Counter("voicewire_replayed_bytes", "Bytes of server frames replayed by resumes",
                                      registry=r)
        self.sessions_waiting = Gauge("voicewire_sessions_waiting_for_resume",
                                      "Sessions whose connection dropped, waiting for a resume", registry=r)
        self.event_loop_tasks = Gauge("voicewire_event_loop_tasks",
                                      "asyncio tasks alive on the server's event loop (read at scrape time)",
                                      registry=r)

        self.gc_pause = Histogram("voicewire_gc_pause_seconds",
                                  "Pauses of Python's cyclic garbage collector in the server process (every "
                                  "session's audio waits for them), by generation", ["generation"],
                                  buckets=GC_BUCKETS, registry=r)

        self.engine_workers = _ReadAtScrape(_worker_families)
        r.register(self.engine_workers)
        self.codec = _ReadAtScrape(_codec_families)
        r.register(self.codec)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def watch_gc(self) -> Callable[[], None]:
        """Time every garbage collection in this process into `gc_pause` (collections started by any
        thread) until the returned function is called; call it exactly once."""
        started: list[float] = []

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                self.gc_pause.labels(str(info["generation"])).observe(time.perf_counter() - started.pop())

        gc.callbacks.append(on_gc)
        return lambda: gc.callbacks.remove(on_gc)


class _ReadAtScrape(Collector, Generic[T]):
    """Metric families made at scrape time (`families`) from what `read` returns then (set by the app; None:
    nothing is exported)."""

    def __init__(self, families: Callable[[T], Iterator[Metric]]) -> None:
        self.read: Callable[[], T | None] = lambda: None
        self._families = families

    def collect(self) -> Iterator[Metric]:
        value = self.read()
        if value is not None:
            yield from self._families(value)


def _worker_families(health: PoolHealth) -> Iterator[Metric]:
    """`voicewire_engine_workers{state}` and `voicewire_worker_restarts_total`, from the engine's worker pool
    (an in-process engine has none)."""
    workers = GaugeMetricFamily("voicewire_engine_workers", "Engine worker processes by state", labels=["state"])
    for state, count in health.counts().items():
        workers.add_metric([state], count)
    yield workers
    yield GaugeMetricFamily("voicewire_engine_requests_waiting_for_worker",
                            "Engine requests waiting for a live worker with a free slot", value=health.waiting)
    yield CounterMetricFamily("voicewire_worker_restarts", "Engine worker processes started to replace one "
                              "that died or was killed", value=health.restarts)


def _codec_families(batcher: CodecBatcher) -> Iterator[Metric]:
    """voicewire's own codec path (`talker_codec.CodecBatcher`; an engine without one has none): decode calls,
    windows, frames and seconds since the engine started, windows decoded after their deadline, the slowest
    call, CUDA graphs captured, batches decoded again in float32; units' time to their first chunk, split at
    the cut of its frames."""
    s = batcher.stats
    yield CounterMetricFamily("voicewire_codec_batches", "Codec decode calls (each a batch of equal-length "
                              "windows)", value=s.batches)
    yield CounterMetricFamily("voicewire_codec_windows", "Chunk windows decoded", value=s.windows)
    yield CounterMetricFamily("voicewire_codec_frames", "Codec frames decoded, left context included",
                              value=s.frames)
    yield CounterMetricFamily("voicewire_codec_decode_seconds", "Time in codec decode calls (copies and "
                              "stream sync included)", value=s.decode_s)
    yield CounterMetricFamily("voicewire_codec_late_windows", "Windows decoded after their deadline (the "
                              "audio before them had run out at the player's pace)", value=s.late)
    yield CounterMetricFamily("voicewire_codec_late_in_codec_windows", "Late windows queued before their "
                              "deadline: the codec's queue and decode made them late (the others were cut at or "
                              "after it, first chunks among them)", value=s.late_in_codec)
    yield CounterMetricFamily("voicewire_codec_fallbacks", "Batches decoded again in float32 (not finite in "
                              "reduced precision)", value=batcher.codec.fallbacks)
    yield CounterMetricFamily("voicewire_codec_first_chunks", "Units whose first chunk was decoded",
                              value=s.first_chunks)
    yield CounterMetricFamily("voicewire_codec_first_frames_seconds", "Time from the engine call to a unit's "
                              "first chunk of frames (prompt, talker queue, prefill, first frames), summed over "
                              "units", value=s.first_frames_s)
    yield CounterMetricFamily("voicewire_codec_first_decode_seconds", "Time from a unit's first chunk of "
                              "frames to its audio (codec queue and decode), summed over units",
                              value=s.first_decode_s)
    yield GaugeMetricFamily("voicewire_codec_max_decode_seconds", "The slowest codec decode call so far",
                            value=s.max_decode_ms / 1000)
    yield GaugeMetricFamily("voicewire_codec_cuda_graphs", "CUDA graphs the codec captured (0 on a CPU: "
                            "it decodes eagerly)", value=batcher.codec.graph_shapes)
