"""Engine construction by name, for the CLI and the app factory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from voicewire.adapters.base import Engine

if TYPE_CHECKING:
    from voicewire.adapters.omni import OmniConfig
    from voicewire.adapters.talker import TalkerConfig

ENGINE_NAMES = ("hibari", "null", "talker", "omni")
Isolation = Literal["thread", "process"]
CLONING_ENGINES: tuple[str, ...] = ("omni",)
"""Engines that can speak an uploaded voice sample: omni with a cloning checkpoint (Qwen3-TTS Base, Fish
Speech S2 Pro)."""


def create_engine(name: str, *, workers: int = 1, isolation: Isolation = "thread",
                  talker: TalkerConfig | None = None, omni: OmniConfig | None = None) -> Engine:
    """Build (not start) the named engine. Raises ValueError for an unknown name, or for `talker`
    without its `TalkerConfig` (model folders), or `omni` without its `OmniConfig`.

    `isolation="process"` runs a CPU engine (hibari) in `workers` child processes, so a crashed worker
    costs only its own units (`adapters/workers.py`); `"thread"` runs it in this process on `workers`
    threads. Other engines ignore it.
    """
    if name == "hibari":
        if isolation == "process":
            from voicewire.adapters.workers import ProcessEngine

            return ProcessEngine("hibari", workers=workers)
        from voicewire.adapters.hibari import HibariEngine

        return HibariEngine(workers=workers)
    if name == "null":
        from voicewire.adapters.null import NullEngine

        return NullEngine()
    if name == "talker":
        if talker is None:
            raise ValueError("engine talker needs --talker-model DIR and --codec-model DIR")
        from voicewire.adapters.talker import TalkerEngine

        return TalkerEngine(talker)
    if name == "omni":
        if omni is None:
            raise ValueError("engine omni needs --model DIR")
        from voicewire.adapters.omni_families import omni_engine

        return omni_engine(omni)
    raise ValueError(f"unknown engine {name!r}; available: {', '.join(ENGINE_NAMES)}")
