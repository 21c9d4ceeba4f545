"""The capacity bench's own machinery: the engine-only ceiling run, core pinning, and the CPU split that
tells the engine's threads from the serving path's (real hibari, in process and in a worker process)."""

from __future__ import annotations

import asyncio
import os

from voicewire.adapters.workers import ProcessEngine
from voicewire.protocol.engine import SynthesisRequest

from bench.capacity import Ceiling, parse_cpus, threads


def test_core_lists_parse_as_taskset_writes_them() -> None:
    assert parse_cpus("0,1") == {0, 1}
    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    assert parse_cpus("") == set()


def test_the_engine_only_run_measures_real_audio_and_cpu_and_restores_the_cores() -> None:
    cores = os.sched_getaffinity(0)

    async def run() -> dict[str, float]:
        ceiling = Ceiling(1, seed=1, cpus=cores, client_cpus=cores)
        await ceiling.engine.start()
        try:
            return await ceiling.measure(0.3)
        finally:
            await ceiling.engine.close()

    measured = asyncio.run(run())
    assert measured["aggregate_rtf"] > 0
    assert measured["cpu_ms_per_audio_s"] > 0
    assert os.sched_getaffinity(0) == cores


def test_a_worker_process_names_its_engine_threads_for_the_kernel() -> None:
    async def run() -> list[str]:
        engine = ProcessEngine("hibari", workers=1)
        await engine.start()
        try:
            request = SynthesisRequest(request_id="names", text="Hello there.", voice=engine.info.voices[0])
            async for _ in engine.synthesize(request):
                pass
            pid = engine.worker_pids()[0]
            assert pid is not None
            return [name for tid, name, _ in threads(pid) if tid != pid]
        finally:
            await engine.close()

    names = asyncio.run(run())
    assert any(name.startswith("hibari") for name in names), names
    assert "worker-outbox" in names
