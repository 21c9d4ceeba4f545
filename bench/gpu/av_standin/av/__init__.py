"""A stand-in for PyAV on the GPU machine (PyAV's wheel, FFmpeg inside, is too large to carry in a device
call): the names that voicewire's `protocol/media.py` and `protocol/encoders.py` use at import, and nothing
that works. The GPU benches stream pcm only, which never reaches PyAV; uploading a voice sample or asking
for mp3, opus or aac fails with `FFmpegError` (which media.py reports as audio it cannot read).

What must be here, and why:
- `codecs_available`: media.py builds its decoder allowlist from it at import (empty: no decoder);
- `FFmpegError`: media.py catches it;
- `open`, `AudioFrame`: called only when decoding or encoding through FFmpeg;
- `av.audio.resampler.AudioResampler`, `av.audio.stream.AudioStream`, `av.container.OutputContainer`:
  imported by name at module level.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.0.0+voicewire-standin"

codecs_available: set[str] = set()
"""No FFmpeg codec is available here."""


class FFmpegError(Exception):
    """What every use of this stand-in raises."""


def _unavailable(what: str) -> FFmpegError:
    return FFmpegError(f"{what}: PyAV is not installed on this machine (bench/gpu stand-in; use pcm)")


def open(*args: Any, **kwargs: Any) -> Any:
    raise _unavailable("av.open")


class AudioFrame:
    """Never constructed: `from_ndarray` raises."""

    @staticmethod
    def from_ndarray(*args: Any, **kwargs: Any) -> AudioFrame:
        raise _unavailable("av.AudioFrame.from_ndarray")
