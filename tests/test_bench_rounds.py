"""What the benches report over rounds: median [min-max] of each round's figure, a pass claimed only when
every round passed, and the header line naming the date, the machine and the commit (`bench.workload`,
and the TTFA and overhead benches' summaries)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from pathlib import Path

import pytest

from bench.overhead import Trial, latency_figures, trial_rows, verdict
from bench.ttfa import ModeResult, summary_rows
from bench.workload import Provenance, cpu_model, git_commit, gpu_names, held_every_round, spread, spreads


def test_a_figure_over_rounds_is_its_median_with_min_and_max_leaving_out_rounds_without_it() -> None:
    assert spread([3.0, 1.0, 2.0]) == "2 [1-3]"
    assert spread([1.0, math.nan, 4.0], "{:.1f}") == "2.5 [1.0-4.0]"
    assert spread([math.nan]) == "-"
    rounds = [{"p50": 10.0, "p95": 30.0}, {"p50": 12.0, "p95": 20.0}, {"p50": 11.0, "p95": 25.0}]
    assert spreads(rounds, {"p95": "{:.0f}", "p50": "{:.1f}"}) == ["25 [20-30]", "11.0 [10.0-12.0]"]


def test_a_level_passes_only_when_it_and_every_smaller_level_passed_in_every_round() -> None:
    passes = {8: [True, True, True], 16: [True, True, True], 24: [True, False, True], 32: [True, True, True]}
    assert held_every_round(passes, 3) == 16
    assert held_every_round({8: [True, True]}, 3) == 0  # a round stopped before it
    assert held_every_round({}, 3) == 0


def test_the_header_names_the_time_span_the_machine_its_load_and_the_commit() -> None:
    p = Provenance("2026-12-05T10:31:07Z", "box", "AMD EPYC 9654", 2, (0.5, 0.4, 0.3), "abc1234+dirty")
    assert p.line() == ("2026-12-05 10:31:07 UTC, box (AMD EPYC 9654, 2 cores), load 0.50 0.40 0.30, "
                        "commit abc1234+dirty")
    done = dataclasses.replace(p, ended="2026-12-05T10:45:12Z", load_after=(1.0, 0.9, 0.8))
    assert done.line() == ("2026-12-05 10:31:07-10:45:12 UTC, box (AMD EPYC 9654, 2 cores), "
                           "load 0.50 0.40 0.30 -> 1.00 0.90 0.80, commit abc1234+dirty")
    overnight = dataclasses.replace(done, ended="2026-12-06T00:02:00Z")
    assert overnight.line().startswith("2026-12-05 10:31:07-2026-12-06 00:02:00 UTC")
    on_gpu = dataclasses.replace(p, gpu="NVIDIA H100 80GB HBM3")
    assert "box (AMD EPYC 9654, 2 cores; NVIDIA H100 80GB HBM3), load" in on_gpu.line()


def test_the_gpus_are_named_as_nvidia_smi_lists_them() -> None:
    assert gpu_names("NVIDIA H200\n") == "NVIDIA H200"
    assert gpu_names("NVIDIA H100 80GB HBM3\nNVIDIA H100 80GB HBM3\n") == "2 x NVIDIA H100 80GB HBM3"
    assert gpu_names("NVIDIA H200\nNVIDIA H100 80GB HBM3\n\n") == "NVIDIA H200 + NVIDIA H100 80GB HBM3"
    assert gpu_names("") == ""


def test_results_written_before_the_gpu_was_recorded_still_read() -> None:
    """`omni_duel --report` rebuilds the header from a results file's `provenance`; older files have no `gpu`."""
    old = {"started": "2026-12-05T10:31:07Z", "host": "box", "cpu": "Xeon", "cores": 16,
           "load_before": [0.5, 0.4, 0.3], "commit": "abc1234", "ended": "", "load_after": None}
    assert Provenance(**old).line() == ("2026-12-05 10:31:07 UTC, box (Xeon, 16 cores), load 0.50 0.40 0.30, "
                                        "commit abc1234")


def test_a_finished_provenance_reads_the_load_again_and_goes_into_json() -> None:
    began = Provenance.begin()
    assert began.load_after is None and began.cores > 0 and began.host
    ended = began.end()
    assert ended.load_after is not None and ended.ended >= began.started
    assert json.loads(json.dumps(ended.as_dict()))["commit"] == ended.commit


def test_the_cpu_model_is_read_from_x86_and_arm_cpuinfo() -> None:
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n\nprocessor\t: 1\n"
    assert cpu_model(x86) == "AMD EPYC 9654 96-Core Processor"
    assert cpu_model("processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd4f\n") == "0xd4f"
    assert cpu_model("") == "unknown CPU"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@example.invalid", *args], cwd=repo,
                   check=True, capture_output=True)


def test_the_commit_is_marked_dirty_by_changed_tracked_files_only(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VOICEWIRE_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("new")
    assert git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two")
    assert git_commit(tmp_path) == head + "+dirty"
    outside = tmp_path / "not-a-checkout"
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert git_commit(outside) == "unknown"
    monkeypatch.setenv("VOICEWIRE_COMMIT", "6e464c8")
    assert git_commit(outside) == "6e464c8"
    assert git_commit(tmp_path) == "6e464c8", "the commit a device call names wins over the copy's git metadata"


def test_ttfa_summarises_each_mode_over_its_rounds() -> None:
    rounds = [[ModeResult("none", ws_ms=[10.0, 12.0], server_ms=[9.0, 11.0], engine_ms=[5.0, 7.0]).summary(),
               ModeResult("sentence", ws_ms=[20.0], server_ms=[19.0], engine_ms=[10.0]).summary()],
              [ModeResult("none", ws_ms=[14.0, 16.0], server_ms=[13.0, 15.0], engine_ms=[9.0, 11.0]).summary(),
               ModeResult("sentence", ws_ms=[30.0], server_ms=[29.0], engine_ms=[20.0]).summary()]]
    none, sentence = summary_rows(rounds, ["none", "sentence"])
    # columns: mode, rounds, engine p50, engine p95, ws p50, ..., overhead p50, overhead p95, path p50, p95, ratio
    assert none[:3] == ["none", 2, "8.0 [6.0-10.0]"]
    assert none[4] == "13.0 [11.0-15.0]"
    assert none[8] == "5.0 [5.0-5.0]"
    assert none[10:12] == ["-", "-"]  # no engine compute counters (a worker process)
    assert sentence[:3] == ["sentence", 2, "15.0 [10.0-20.0]"]


def _trial(server: str, n: int, round_: int, underruns: int = 0, cpu: float = 0.2) -> Trial:
    return Trial(server, n, round_, latencies_ms=[1.0, 2.0, 3.0], underruns=underruns, audio_s=n, window_s=1.0,
                 server_cpu=cpu)


def test_overhead_claims_a_stream_count_only_where_every_round_passed() -> None:
    trials = [_trial("voicewire", 100, 0), _trial("voicewire", 200, 0), _trial("voicewire", 100, 1),
              _trial("voicewire", 200, 1, underruns=3), _trial("voicewire", 100, 2), _trial("voicewire", 200, 2)]
    rows = trial_rows(trials, lead_s=0.3)
    assert [row[:5] for row in rows] == [["voicewire", 100, 3, "yes yes yes", "0 0 0"],
                                         ["voicewire", 200, 3, "yes no yes", "0 3 0"]]
    assert rows[0][6] == "2.00 [2.00-2.00]"  # latency p50
    assert verdict(trials, "voicewire", 3, 0.3).startswith(
        "voicewire: largest N passed in every round 100 (per round: 200 100 200); CPU-bound estimate")


def test_overhead_latency_figures_give_the_serving_paths_addition_and_ratio() -> None:
    figures = latency_figures({"voicewire": [2.0, 2.0, 4.0], "baseline": [1.0, 1.0, 1.0]})
    assert figures["added p50"] == 1.0
    assert figures["ratio p50"] == 2.0
    assert figures["voicewire p99"] == pytest.approx(3.96)
