"""A vllm-omni platform for vLLM's CPU build (dev and CI; random-weight models, two cores are enough).

Pattern of vllm-omni's own XPU platform: each stage worker is vLLM's device worker (`CPUWorker`) with
vllm-omni's worker mixin, and its model runner combines vllm-omni's runner (the AR talker runner, or the
generation runner of non-autoregressive stages such as code2wav) with vLLM's `CPUModelRunner`, so the
runner's device hooks are the CPU ones. vllm-omni's hooks live in the v1 model runner only, so the v2
runner is turned off (`omni_cpu_workers`).

Loaded by vllm-omni in every stage process through `voicewire.adapters.omni_cpu.platform_plugin`. The
workers are in `omni_cpu_workers` and named, not imported, here: vllm-omni's runners import its
connectors, which import the platform (an import cycle if this module imported them).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

_WORKERS = "voicewire.adapters.omni_cpu_workers"


class CPUOmniPlatform(OmniPlatform, CpuPlatform):  # type: ignore[misc]
    """vLLM's CPU platform with vllm-omni's stage workers (see the module doc)."""

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return f"{_WORKERS}.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return f"{_WORKERS}.CPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: Any, head_size: int,
                                       allow_trtllm_default: bool = True) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        return str(DiffusionAttentionBackendEnum.TORCH_SDPA.get_path())

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    @classmethod
    def create_autocast_context(cls, *args: Any, **kwargs: Any) -> AbstractContextManager[None]:
        return nullcontext()
