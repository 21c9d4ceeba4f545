"""A timing probe for vllm-omni's talker stage, loaded by Python at start-up (`sitecustomize`) in every process
that has this folder on `PYTHONPATH` and `VW_PROBE=1` in its environment (bench/gpu/probe_burst.sh).

It wraps, once their modules are imported, the calls that make up one talker step and writes one line per
call: `VWPROBE <pid> <what> <start, CLOCK_MONOTONIC s> <ms> <details>`, appended to the file `VW_PROBE_FILE` names
(one `write` per line, so the lines of every process and thread stay whole), or printed to standard error without
it (where a server that relays its workers' output may join two lines into one). CLOCK_MONOTONIC is
one clock for every process of the machine, so the lines of the engine core, the talker's worker and the
server line up. Each process that imports a wrapped module first says who its parent is
(`VWPROBE <pid> process 0 0 ppid=<pid>`: a stage's worker is its engine core's child). Wrapped:
- vLLM's `EngineCore.add_request` (a request reaching a stage's engine core) and `EngineCore.step` /
  `step_with_batch_queue` (steps taking 1 ms or more);
- vllm-omni's model runner: `execute_model`, `sample_tokens`, `_preprocess` (with the step's requests,
  tokens and prefilling requests), `_maybe_run_batch_preprocess`, `_talker_mtp_forward` (its batch);
- the Qwen3-TTS talker's `preprocess` for a prefilling request (one line per request);
- in voicewire's server, the `omni` engine's `synthesize` (the engine call of a unit: an instant, 0 ms).
Measurement only: nothing here changes what the wrapped calls do or return. On the path it takes the place of
any other `sitecustomize` (Debian's Python has one for apport), so use it for probe runs only.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

_PATH = os.environ.get("VW_PROBE_FILE")
_SINK: dict[int, int] = {}
"""This process's descriptor of `VW_PROBE_FILE`, by pid (a forked child opens its own)."""


def _write(line: str) -> None:
    """One whole line to `VW_PROBE_FILE` (a single `write` in append mode), or to standard error without it."""
    if not _PATH:
        print(line, file=sys.stderr, flush=True)
        return
    pid = os.getpid()
    if pid not in _SINK:
        _SINK[pid] = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_SINK[pid], f"{line}\n".encode())


def _say(what: str, start: float, details: str = "") -> None:
    _write(f"VWPROBE {os.getpid()} {what} {start:.6f} {(time.monotonic() - start) * 1000:.3f} {details}")


def _timed(owner: type, name: str, what: str, details: Callable[..., str] | None = None,
           least_ms: float = 0.0, when: Callable[..., bool] | None = None) -> None:
    """Wrap `owner.name` so that each call (each one `when` accepts, taking `least_ms` or more) prints a line."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_vw_probe", False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when is not None and not when(*args, **kwargs):
            return original(*args, **kwargs)
        start = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            if (time.monotonic() - start) * 1000 >= least_ms:
                try:
                    text = details(*args, **kwargs) if details is not None else ""
                except Exception as exc:  # a probe never breaks the call it measures
                    text = f"details failed: {exc!r}"
                _say(what, start, text)

    wrapper._vw_probe = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _preprocess_details(runner: Any, scheduler_output: Any, *_: Any, **__: Any) -> str:
    batch = runner.input_batch
    prefill = 0
    for index, req_id in enumerate(batch.req_ids):
        state = runner.requests.get(req_id)
        prompt = len(getattr(state, "prompt_token_ids", ()) or ())
        if int(batch.num_computed_tokens_cpu[index]) < prompt:
            prefill += 1
    return (f"reqs={len(batch.req_ids)} tokens={scheduler_output.total_num_scheduled_tokens} "
            f"new={len(scheduler_output.scheduled_new_reqs)} prefill_after={prefill}")


def _patch_core(module: ModuleType) -> None:
    core = module.EngineCore
    _timed(core, "add_request", "add_request",
           lambda _self, request, *a, **k: f"id={getattr(request, 'request_id', '?')}")
    _timed(core, "step", "step", least_ms=1.0)
    _timed(core, "step_with_batch_queue", "step_bq", least_ms=1.0)


def _patch_runner(module: ModuleType) -> None:
    runner = module.OmniGPUModelRunner
    _timed(runner, "_preprocess", "preprocess", _preprocess_details)
    _timed(runner, "_maybe_run_batch_preprocess", "batch_preprocess")
    _timed(runner, "_talker_mtp_forward", "talker_mtp", lambda _self, ids, *a, **k: f"batch={len(ids)}")


def _patch_ar_runner(module: ModuleType) -> None:
    runner = module.GPUARModelRunner
    _timed(runner, "execute_model", "execute_model")
    _timed(runner, "sample_tokens", "sample_tokens")


def _patch_talker(module: ModuleType) -> None:
    _timed(module.Qwen3TTSTalkerForConditionalGeneration, "preprocess", "prefill_preprocess",
           lambda *_, **kwargs: f"id={kwargs.get('request_id')}",
           when=lambda *_, **kwargs: bool(kwargs.get("_omni_is_prefill")))


def _patch_engine(module: ModuleType) -> None:
    _timed(module.OmniEngine, "synthesize", "engine_call", lambda _self, request: f"id={request.request_id}")


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "voicewire.adapters.omni": _patch_engine,
    "vllm.v1.engine.core": _patch_core,
    "vllm_omni.worker.gpu_model_runner": _patch_runner,
    "vllm_omni.worker.gpu_ar_model_runner": _patch_ar_runner,
    "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker": _patch_talker,
}


_introduced: set[int] = set()
"""The processes that said who their parent is (a forked child inherits this module, not its lines)."""


def _introduce() -> None:
    if os.getpid() not in _introduced:
        _introduced.add(os.getpid())
        _write(f"VWPROBE {os.getpid()} process 0 0 ppid={os.getppid()}")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _introduce()
        try:
            self.patch(module)
        except Exception as exc:
            print(f"VWPROBE {os.getpid()} patch_failed 0 0 {module.__name__}: {exc!r}", file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, patch)
        return spec


if os.environ.get("VW_PROBE") == "1":
    sys.meta_path.insert(0, _Finder())
