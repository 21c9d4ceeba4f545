"""A stand-in for PyAV on the GPU machine (PyAV's wheel, FFmpeg inside, is too large to carry in a device
call): the names that voicewire's `protocol/media.py` and `protocol/encoders.py` use, of which only one
path works: decoding a 16-bit PCM WAV (read with the standard library's `wave`) to mono float32 at its own
rate, which is what a cloning bench's reference audio needs (`bench/omni_duel.py --task-types Base`). The
GPU benches stream pcm, which never reaches PyAV; any other container or coding, and every encoder (mp3,
opus, aac), fails with `FFmpegError` (which media.py reports as audio it cannot read).

What must be here, and why:
- `codecs_available`: media.py builds its decoder allowlist from it at import (`pcm_s16le` only);
- `FFmpegError`: media.py catches it;
- `open`: media.py's decoder (WAV only); `AudioFrame`: the encoders (never works here);
- `av.audio.resampler.AudioResampler`, `av.audio.stream.AudioStream`, `av.container.OutputContainer`:
  imported by name at module level; the resampler only downmixes to mono float32 at the same rate.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from typing import Any

import numpy as np

__version__ = "0.0.0+voicewire-standin"

codecs_available: set[str] = {"pcm_s16le"}
"""The one decoder this stand-in has."""

_FRAME_SAMPLES = 4096
"""Samples per decoded frame (per channel)."""


class FFmpegError(Exception):
    """What every unsupported use of this stand-in raises."""


def _unavailable(what: str) -> FFmpegError:
    return FFmpegError(f"{what}: PyAV is not installed on this machine (bench/gpu stand-in; use pcm)")


class _Layout:
    def __init__(self, channels: int) -> None:
        self.nb_channels = channels


class AudioFrame:
    """Planar float32 samples `(channels, samples)` at `sample_rate`; `from_ndarray` (encoding) raises."""

    def __init__(self, planes: np.ndarray, sample_rate: int) -> None:
        self._planes = planes
        self.sample_rate = sample_rate
        self.samples = planes.shape[1]
        self.layout = _Layout(planes.shape[0])

    def to_ndarray(self) -> np.ndarray:
        return self._planes

    @staticmethod
    def from_ndarray(*args: Any, **kwargs: Any) -> AudioFrame:
        raise _unavailable("av.AudioFrame.from_ndarray")


class _Codec:
    name = "pcm_s16le"


class _CodecContext:
    codec = _Codec()


class _WavStream:
    """The one audio stream of a WAV: `decode(packet)` turns a packet of int16 samples into a frame."""

    codec_context = _CodecContext()

    def __init__(self, rate: int, channels: int) -> None:
        self.rate = rate
        self.channels = channels

    def decode(self, packet: bytes) -> list[AudioFrame]:
        ints = np.frombuffer(packet, dtype="<i2").reshape(-1, self.channels).T
        return [AudioFrame(ints.astype(np.float32) / 32768.0, self.rate)]


class _Streams:
    def __init__(self, stream: _WavStream) -> None:
        self.audio = [stream]


class _WavSource:
    """An opened 16-bit PCM WAV held in memory; a context manager, as `av.open`'s container is."""

    def __init__(self, data: bytes) -> None:
        try:
            self._wav = wave.open(io.BytesIO(data), "rb")
        except (wave.Error, EOFError) as exc:
            raise FFmpegError(f"not a PCM WAV: {exc}") from None
        if self._wav.getsampwidth() != 2:
            raise _unavailable(f"a {8 * self._wav.getsampwidth()}-bit WAV")
        self.streams = _Streams(_WavStream(self._wav.getframerate(), self._wav.getnchannels()))

    def demux(self, stream: _WavStream) -> Iterator[bytes]:
        while chunk := self._wav.readframes(_FRAME_SAMPLES):
            yield chunk

    def __enter__(self) -> _WavSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._wav.close()


def open(file: Any, mode: str = "r", format: str | None = None, **kwargs: Any) -> Any:
    """A WAV in memory, read (`format="wav"`); anything else raises `FFmpegError`."""
    if mode != "r" or format != "wav" or not isinstance(file, io.BytesIO):
        raise _unavailable(f"av.open(mode={mode!r}, format={format!r})")
    return _WavSource(file.getvalue())
