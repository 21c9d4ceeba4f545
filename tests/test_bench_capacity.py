"""The capacity bench's own machinery: the engine-only ceiling run, core pinning, the CPU split that tells
the engine's threads from the serving path's (real hibari, in process and in a worker process), and its
verdict over rounds (zero underruns claimed only where every round had none)."""

from __future__ import annotations

import asyncio
import math
import os

import pytest
from voicewire.adapters.workers import ProcessEngine
from voicewire.protocol.engine import SynthesisRequest

from bench.capacity import Ceiling, Reply, SearchResult, Trial, parse_cpus, threads


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


def _trial(sessions: int, round_: int, underruns: int = 0, ceiling: float = 40.0) -> Trial:
    """One trial whose single reply played 0-10 s, with `underruns` late units."""
    reply = Reply(0.05 + round_ / 100, 10.0, 0.1 * underruns, 3, [1] * underruns, [], 0.0, 10.0)
    return Trial(sessions, round_, [reply], window=(0.0, 10.0), server_loop_cpu=0.1, server_other_cpu=0.2,
                 ceiling={"aggregate_rtf": ceiling, "cpu_ms_per_audio_s": 10.0})


def test_capacity_claims_zero_underruns_only_for_an_n_that_had_none_in_every_round() -> None:
    result = SearchResult([_trial(16, 0), _trial(32, 0), _trial(24, 0),
                           _trial(16, 1), _trial(24, 1), _trial(32, 1, underruns=2),
                           _trial(16, 2), _trial(24, 2), _trial(32, 2)], rounds=3)
    assert result.max_sessions == 24
    rows = result.rows()
    # N, rounds, pass per round, underruns per round, passed in every round, then median [min-max]
    assert [row[:5] for row in rows] == [[16, 3, "yes yes yes", "0 0 0", "yes"],
                                         [24, 3, "yes yes yes", "0 0 0", "yes"],
                                         [32, 3, "yes no yes", "0 2 0", "no"]]
    assert rows[0][6] == "60 [50-70]"  # TTFA p50 ms over the three rounds
    summary = result.as_dict()
    assert summary["passed_every_round"] == {16: True, 32: False, 24: True}
    trials = summary["trials"]
    assert isinstance(trials, list)
    assert [t["round"] for t in trials] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_capacity_claims_nothing_when_a_round_did_not_run_an_n() -> None:
    assert SearchResult([_trial(16, 0), _trial(16, 1)], rounds=3).max_sessions == 0


def test_capacity_cpu_figures_are_each_rounds_median_over_its_passing_trials() -> None:
    failed = _trial(32, 0, underruns=1)
    failed.server_loop_cpu = 1.0
    result = SearchResult([_trial(16, 0), failed, _trial(16, 1)], rounds=3)
    medians = result.round_medians(lambda t: t.cpu_per_stream_ms)
    assert medians[:2] == pytest.approx([300.0, 300.0])  # 0.3 cores for one stream playing; `failed` left out
    assert math.isnan(medians[2])
    engine_alone = result.round_medians(lambda t: t.ceiling["cpu_ms_per_audio_s"], passing_only=False)
    assert engine_alone[:2] == [10.0, 10.0]
