"""Decoding REST responses the way a client would: libsndfile for wav/flac/ogg/mp3, FFmpeg (PyAV) for aac."""

from __future__ import annotations

import io

import av
import numpy as np
import numpy.typing as npt
import soundfile as sf

FloatAudio = npt.NDArray[np.float32]


def decode(data: bytes, fmt: str, *, pcm_rate: int = 24000) -> tuple[FloatAudio, int]:
    """Mono float32 samples and the file's sample rate (`pcm_rate` for headerless pcm)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0, pcm_rate
    if fmt == "aac":
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            frames = [f.to_ndarray().mean(axis=0) for f in container.decode(stream)]
            return np.concatenate(frames).astype(np.float32), int(stream.rate)
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples.mean(axis=1), int(rate)


def tone(seconds: float, rate: int = 24000, hz: float = 220.0) -> FloatAudio:
    t = np.arange(round(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def pcm16(samples: FloatAudio) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
