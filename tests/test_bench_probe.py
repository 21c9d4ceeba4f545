"""The talker step probe (`bench/gpu/step_probe`) and its report (`bench.probe_report`): the probe wraps the
calls it names in the vllm and vllm-omni this project installs (so a version that renames them fails here, not
on a GPU machine), and the report reads a real probe trace (`tests/data/probe_burst16_cpu.txt`: a burst of 16
sessions on the tiny CPU Qwen3-TTS through voicewire's server, captured with the probe, 2026-12-07) into its
timeline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.probe_report import arrivals, bursts, parse, report, talker_steps, talker_worker

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "bench" / "gpu" / "step_probe"
TRACE = Path(__file__).resolve().parent / "data" / "probe_burst16_cpu.txt"

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


def _imports(probe: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(PROBE)}
    env.pop("VW_PROBE", None)
    if probe:
        env["VW_PROBE"] = "1"
    return subprocess.run([sys.executable, "-c", WRAPPED], env=env, capture_output=True, text=True, timeout=180,
                          check=True)


def test_the_probe_wraps_every_call_it_names_in_the_installed_vllm_omni_and_only_when_asked() -> None:
    probed = _imports(probe=True)
    assert "wrapped 10 of 10" in probed.stdout, probed.stderr[-2000:]
    assert "patch_failed" not in probed.stderr
    assert f"VWPROBE {_pid_of(probed.stderr)} process 0 0 ppid=" in probed.stderr
    assert "wrapped 0 of 10" in _imports(probe=False).stdout


def _pid_of(stderr: str) -> str:
    line = next(line for line in stderr.splitlines() if line.startswith("VWPROBE "))
    return line.split()[1]


def test_the_report_finds_the_bursts_their_engine_calls_prompts_and_the_talker_steps_after_them() -> None:
    # the trace's 16 sessions: 15 requests reached the talker's core together, the 16th after the talker's
    # next step, 127 ms after its engine call
    events = parse(TRACE.read_text().splitlines())
    worker = talker_worker(events)
    groups = bursts(arrivals(events, worker), gap_ms=50.0)
    assert [len(group) for group in groups] == [15, 1]
    steps = talker_steps(events, worker)
    built = {p.details["id"] for step in steps for p in step.prefills}
    assert built == {event.details["id"] for group in groups for event in group}
    assert all(step.execute.ms > 0 for step in steps)
    text = report(events, steps_shown=3, gap_ms=50.0)
    heads = [line for line in text.splitlines() if line.startswith("burst of ")]
    assert heads[0].startswith("burst of 15 (arrivals over ") and heads[0].endswith("prompts built 15")
    late = float(heads[1].split("engine calls from ")[1].split()[0])
    assert late < -100.0  # its engine call came over 100 ms before it reached the talker
    assert [line.split()[:2] for line in text.splitlines()[-2:]] == [["1", "1"], ["15", "1"]]


def test_the_report_says_so_when_the_trace_has_no_process_lines() -> None:
    lines = [line for line in TRACE.read_text().splitlines() if " process " not in line]
    events = parse(lines)
    with pytest.raises(ValueError, match="parent"):
        arrivals(events, talker_worker(events))
