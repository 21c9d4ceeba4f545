"""PyAV stand-in: `av.audio.resampler` (see `av/__init__.py`)."""

from __future__ import annotations

from typing import Any

from av import _unavailable


class AudioResampler:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _unavailable("av.audio.resampler.AudioResampler")
