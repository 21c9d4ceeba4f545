"""Admission by capacity: a new WebSocket session is refused while the engine's measured capacity is
spoken for, so the sessions already admitted keep playing without running dry.

- Speed: seconds of audio the engine's units produced per second an engine slot spent on them
  (`voicewire_engine_audio_seconds` over `voicewire_engine_busy_seconds`, both counted as each unit's engine
  work ends), measured over windows of at least `WINDOW_ENGINE_S` engine seconds, each new window weighing
  half. It is measured under the load the machine really has, other processes included.
- Capacity: engine slots x speed, in real-time streams (one listener consumes one second of audio per
  second).
- Demand: the sessions *speaking* now (with units queued, synthesizing or unsent) and the REST speech
  requests in progress, one stream each. Sessions waiting for text cost nothing.
- Rule: a new session is admitted while demand + 1 <= `Settings.admission_utilization` x capacity; else it
  is closed with 1013 "server at capacity; retry after N s". Before the first window is measured, and with
  `admission_utilization` 0, only `max_sessions` applies.

Sessions admitted while others were silent can still start speaking together: the rule keeps a new
session from joining an engine that is already busy, it does not reserve capacity for silent sessions
(`max_sessions` bounds those).
"""

from __future__ import annotations

from typing import Final

from voicewire.realtime.metrics import Metrics

WINDOW_ENGINE_S: Final = 1.0
RETRY_AFTER_S: Final = 5


class Admission:
    """The speed estimate and the admission rule of one server (see the module docstring)."""

    def __init__(self, metrics: Metrics, utilization: float) -> None:
        self.metrics = metrics
        self.utilization = utilization
        self.speed: float | None = None
        """Audio seconds per engine-slot second; None until the first window is measured."""
        self._window_audio_s = 0.0
        self._window_engine_s = 0.0

    def measure(self) -> float | None:
        """Fold the engine work done since the last window into `speed` once it spans `WINDOW_ENGINE_S`."""
        audio_s = self._total("voicewire_engine_audio_seconds_total")
        engine_s = self._total("voicewire_engine_busy_seconds_total")
        spent = engine_s - self._window_engine_s
        if spent >= WINDOW_ENGINE_S:
            sample = (audio_s - self._window_audio_s) / spent
            self.speed = sample if self.speed is None else (self.speed + sample) / 2
            self._window_audio_s, self._window_engine_s = audio_s, engine_s
        return self.speed

    def capacity(self, slots: int) -> float | None:
        """Real-time streams admission may fill: `utilization` x slots x speed (None: not measured yet)."""
        speed = self.measure()
        return None if speed is None else self.utilization * slots * speed

    def admits(self, speaking: int, slots: int) -> bool:
        """Whether one more session fits beside `speaking` streams on `slots` engine slots. An idle server
        always admits one: a measured speed dragged down by units that failed without audio (a timeout, a
        dead worker) must not lock out every session."""
        if self.utilization <= 0 or speaking == 0:
            return True
        capacity = self.capacity(slots)
        return capacity is None or speaking + 1 <= capacity

    def _total(self, sample: str) -> float:
        return self.metrics.registry.get_sample_value(sample) or 0.0
