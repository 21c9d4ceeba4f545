"""The talker step probe (`bench/gpu/step_probe`) and its report (`bench.probe_report`): the probe wraps the
calls it names in the vllm and vllm-omni this project installs (so a version that renames them fails here, not
on a GPU machine), and the report reads real probe traces into their timelines: `tests/data/probe_burst16_cpu.txt`
(a burst of 16 sessions on the tiny CPU Qwen3-TTS through voicewire's server, 2026-12-07) and
`tests/data/probe_burst64_h100.txt` (a burst of 64 on Qwen3-TTS 1.7B shapes, one H100, 2026-12-07)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.probe_report import SUMMARY, arrivals, bursts, match, parse, report, talker_steps, talker_worker

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "bench" / "gpu" / "step_probe"
TRACE = Path(__file__).resolve().parent / "data" / "probe_burst16_cpu.txt"
GPU_TRACE = Path(__file__).resolve().parent / "data" / "probe_burst64_h100.txt"

WRAPPED = """
import vllm.v1.engine.core as core
import vllm_omni.worker.gpu_model_runner as runner
import vllm_omni.worker.gpu_ar_model_runner as ar
import vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker as talker
import voicewire.adapters.omni as omni
calls = [omni.OmniEngine.synthesize, core.EngineCore.add_request, core.EngineCore.step,
         core.EngineCore.step_with_batch_queue,
         runner.OmniGPUModelRunner._preprocess, runner.OmniGPUModelRunner._maybe_run_batch_preprocess,
         runner.OmniGPUModelRunner._talker_mtp_forward, ar.GPUARModelRunner.execute_model,
         ar.GPUARModelRunner.sample_tokens, talker.Qwen3TTSTalkerForConditionalGeneration.preprocess]
print("wrapped", sum(bool(getattr(call, "_vw_probe", False)) for call in calls), "of", len(calls))
"""


def _imports(probe: bool, sink: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(PROBE)}
    env.pop("VW_PROBE", None)
    env.pop("VW_PROBE_FILE", None)
    if probe:
        env["VW_PROBE"] = "1"
    if sink is not None:
        env["VW_PROBE_FILE"] = str(sink)
    return subprocess.run([sys.executable, "-c", WRAPPED], env=env, capture_output=True, text=True, timeout=180,
                          check=True)


def test_the_probe_wraps_every_call_it_names_in_the_installed_vllm_omni_and_only_when_asked(tmp_path: Path) -> None:
    probed = _imports(probe=True)
    assert "wrapped 10 of 10" in probed.stdout, probed.stderr[-2000:]
    assert "patch_failed" not in probed.stderr
    assert f"VWPROBE {_pid_of(probed.stderr)} process 0 0 ppid=" in probed.stderr
    assert "wrapped 0 of 10" in _imports(probe=False).stdout
    # with VW_PROBE_FILE the lines go to that file, whole, and none to standard error
    sink = tmp_path / "probe.txt"
    to_file = _imports(probe=True, sink=sink)
    assert "wrapped 10 of 10" in to_file.stdout
    assert "VWPROBE" not in to_file.stderr
    assert [line.split()[2:5] for line in sink.read_text().splitlines()] == [["process", "0", "0"]]


def _pid_of(stderr: str) -> str:
    line = next(line for line in stderr.splitlines() if line.startswith("VWPROBE "))
    return line.split()[1]


def _summary(text: str, size: int) -> dict[str, str]:
    """The report's summary row for bursts of `size`, by figure (each `median [min-max]`)."""
    row = next(line for line in text.splitlines() if line.split()[:1] == [str(size)])
    cells = re.findall(r"\S+ \[[^\]]+\]|(?<!\S)-(?!\S)", row.split(maxsplit=2)[2])
    return dict(zip(SUMMARY, cells, strict=True))


def test_the_report_follows_a_cpu_burst_from_its_engine_calls_to_its_first_decode_step() -> None:
    # the CPU trace's 16 sessions (the talker's worker a child of its engine core): their engine calls came
    # together, the first request was prefilled alone, 14 in the next step, the 16th reached the core after
    # that step, over 100 ms after its engine call, and was prefilled a step later
    events = parse(TRACE.read_text().splitlines())
    worker = talker_worker(events)
    calls = [event for event in events if event.what == "engine_call"]
    groups = bursts(calls, gap_ms=50.0)
    assert [len(group) for group in groups] == [16]
    burst = match(groups[0], talker_steps(events, worker), arrivals(events, worker))
    assert len(burst.arrived) == 16 and burst.ms(burst.arrived[-1].start) > 100.0
    assert [len(step.prefills) for step in burst.prefill_steps] == [1, 14, 1]
    assert {p.details["id"].rsplit("-", 1)[0] for p in burst.built()} == {call.details["id"] for call in groups[0]}
    assert all(not step.prefills for step in burst.decode_steps())
    text = report(events, steps_shown=3, gap_ms=50.0)
    head = text.splitlines()[0]
    assert head.startswith("burst of 16 engine calls over ")
    assert head.endswith("16 reached the talker's core from 7.6 to 129.5 ms, prompts built 16 in 3 steps")
    figures = _summary(text, 16)
    assert figures["prefill steps"] == "3.0 [3.0-3.0]"
    assert figures["calls to the core's last arrival"] == "129.5 [129.5-129.5]"


def test_the_report_reads_a_gpu_trace_whose_talker_runs_in_its_engine_cores_process() -> None:
    # an H100 burst of 64 (2026-12-07, 254ac6b, tests/data/probe_burst64_h100.txt): there the talker's model runs in
    # its engine core's process; the probe printed to standard error, and the server's relay joined two lines,
    # so one request's arrival is missing; its prompt is still counted by its engine call's id
    events = parse(GPU_TRACE.read_text().splitlines())
    worker = talker_worker(events)
    assert any(event.what == "add_request" and event.pid == worker for event in events)
    text = report(events, steps_shown=4, gap_ms=50.0)
    assert "burst of 64 engine calls" in text and "63 reached" in text and "prompts built 64 in 3 steps" in text
    figures = _summary(text, 64)
    assert figures["prefill steps"] == "3.0 [3.0-3.0]"
    assert figures["calls to the core's last arrival"] == "-"
    assert figures["one prompt's build"] == "1.6 [1.6-1.6]"


def test_the_report_says_so_when_the_trace_has_no_process_lines() -> None:
    lines = [line for line in TRACE.read_text().splitlines() if " process " not in line]
    events = parse(lines)
    with pytest.raises(ValueError, match="parent"):
        arrivals(events, talker_worker(events))
