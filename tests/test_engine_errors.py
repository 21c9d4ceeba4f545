"""One engine error taxonomy: every engine failure maps to a stable code in one place (`failure_of`)."""

from __future__ import annotations

from voicewire.adapters.workers import EngineWorkerDied, EngineWorkerError
from voicewire.protocol.engine import EngineError, EngineWorkerLost, UnitTimeout, failure_of


def test_each_failure_has_its_code_and_a_reason() -> None:
    assert failure_of(UnitTimeout("timed out after 1 s")) == ("unit_timeout", "timed out after 1 s")
    assert failure_of(EngineWorkerDied("engine worker 0 died")) == ("generation_failed", "engine worker 0 died")
    assert failure_of(EngineWorkerError("boom", "generation_failed")) == ("generation_failed", "boom")
    assert failure_of(EngineWorkerError("too long", "unit_too_long")) == ("unit_too_long", "too long")
    assert failure_of(ValueError()) == ("generation_failed", "ValueError")
    assert issubclass(EngineWorkerDied, EngineWorkerLost) and issubclass(EngineWorkerError, EngineError)
