"""The CPU platform's stage workers (`omni_cpu_platform`): vLLM's `CPUWorker` with vllm-omni's worker mixin,
and vllm-omni's model runners on vLLM's `CPUModelRunner`. vllm-omni's hooks live in its v1 runners, so the
v2 runner is turned off."""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

log = init_logger(__name__)


class _NoCudaGraphSizes:
    """vLLM's CPU build captures no CUDA graphs and leaves `compilation_config.max_cudagraph_capture_size`
    unset (None), which vllm-omni's talker set-up compares with an int (`max(max_num_reqs, it)`). While that
    set-up runs it reads 0, the truth on CPU; the config is left as vLLM made it (setting it in the
    platform's `check_and_update_config` does not reach the stage workers)."""

    compilation_config: Any

    def _init_talker_mtp(self) -> Any:
        config = self.compilation_config
        unset = config.max_cudagraph_capture_size is None
        if unset:
            config.max_cudagraph_capture_size = 0
        try:
            return super()._init_talker_mtp()  # type: ignore[misc]
        finally:
            if unset:
                config.max_cudagraph_capture_size = None


class CPUARModelRunner(_NoCudaGraphSizes, GPUARModelRunner, CPUModelRunner):  # type: ignore[misc]
    """vllm-omni's autoregressive (talker) runner on vLLM's CPU runner."""


class CPUGenerationModelRunner(_NoCudaGraphSizes, GPUGenerationModelRunner, CPUModelRunner):  # type: ignore[misc]
    """vllm-omni's generation (e.g. code2wav) runner on vLLM's CPU runner."""


class _CPUStageWorker(OmniWorkerMixin, CPUWorker):  # type: ignore[misc]
    model_runner_cls: type[Any]

    def init_device(self) -> None:
        # vLLM builds its plain CPUModelRunner here; the stage needs vllm-omni's, made below.
        super().init_device()  # type: ignore[no-untyped-call]
        if getattr(self, "use_v2_model_runner", False):
            log.warning("omni CPU worker: using the v1 model runner (vllm-omni's hooks are there)")
        self.use_v2_model_runner = False
        self.model_runner = self.model_runner_cls(self.vllm_config, torch.device("cpu"))


class CPUARWorker(_CPUStageWorker):
    model_runner_cls = CPUARModelRunner


class CPUGenerationWorker(_CPUStageWorker):
    model_runner_cls = CPUGenerationModelRunner
