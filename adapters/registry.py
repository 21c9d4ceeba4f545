"""Engine construction by name, for the CLI and the app factory."""

from __future__ import annotations

from voicewire.adapters.base import Engine

ENGINE_NAMES = ("hibari", "null")


def create_engine(name: str, *, workers: int = 1) -> Engine:
    """Build (not start) the named engine. Raises ValueError for an unknown name."""
    if name == "hibari":
        from voicewire.adapters.hibari import HibariEngine

        return HibariEngine(workers=workers)
    if name == "null":
        from voicewire.adapters.null import NullEngine

        return NullEngine()
    raise ValueError(f"unknown engine {name!r}; available: {', '.join(ENGINE_NAMES)}")
