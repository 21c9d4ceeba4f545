"""Audio the server sends, decoded to 16-bit PCM: per-unit stream decoding, the `Audio` result type, WAV.

The streamable formats (`pcm`, `wav`, `mulaw`, `alaw`) decode to int16 samples chunk by chunk with
`UnitDecoder`; each synthesis unit's bytes start afresh (a `wav` unit starts with its own header). The
whole-file formats (`flac`, `mp3`, `opus`, `aac`) are kept as the bytes the server sent: this client does not
depend on a codec library.
"""

from __future__ import annotations

import io
import struct
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
from numpy.typing import NDArray

Int16Array = NDArray[np.int16]

DECODABLE_FORMATS: Final = frozenset({"pcm", "wav", "mulaw", "alaw"})
"""Formats `UnitDecoder` turns into samples; the others are kept as file bytes."""


def _mulaw_table() -> Int16Array:
    u = ~np.arange(256, dtype=np.int64) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_table() -> Int16Array:
    a = np.arange(256, dtype=np.int64) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


_MULAW: Final = _mulaw_table()
_ALAW: Final = _alaw_table()
_WAV_MIN_HEADER: Final = 44


class UnitDecoder:
    """Decodes one unit's audio bytes, fed in arbitrary pieces, to int16 samples (G.711 reference decode
    for mu-law/A-law). Holds at most one odd byte of pcm16 and, for `wav`, the header until it is whole."""

    def __init__(self, fmt: str) -> None:
        if fmt not in DECODABLE_FORMATS:
            raise ValueError(f"cannot decode {fmt!r} audio; decodable formats: {', '.join(sorted(DECODABLE_FORMATS))}")
        self.format = fmt
        self._pending = b""
        self._in_header = fmt == "wav"

    def feed(self, data: bytes) -> Int16Array:
        """Samples decoded from `data` (plus bytes held from earlier calls)."""
        buf = self._pending + data
        self._pending = b""
        if self._in_header:
            body = _strip_wav_header(buf)
            if body is None:
                self._pending = buf
                return np.zeros(0, np.int16)
            self._in_header = False
            buf = body
        if self.format == "mulaw":
            return _MULAW[np.frombuffer(buf, np.uint8)]
        if self.format == "alaw":
            return _ALAW[np.frombuffer(buf, np.uint8)]
        whole = len(buf) - len(buf) % 2
        self._pending = buf[whole:]
        return np.frombuffer(buf[:whole], "<i2").astype(np.int16)


def _strip_wav_header(buf: bytes) -> bytes | None:
    """The bytes after a RIFF header's `data` chunk header, or None while the header is incomplete."""
    if len(buf) < _WAV_MIN_HEADER:
        return None
    if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
        raise ValueError("wav audio does not start with a RIFF/WAVE header")
    pos = 12
    while pos + 8 <= len(buf):
        chunk_id, size = buf[pos:pos + 4], struct.unpack_from("<I", buf, pos + 4)[0]
        if chunk_id == b"data":
            return buf[pos + 8:]
        pos += 8 + size + (size & 1)
    return None


@dataclass(slots=True)
class Audio:
    """Mono audio of one utterance: int16 `samples` at `sample_rate` (decodable formats), or the
    concatenated whole files the server sent (`encoded`, for `flac`/`mp3`/`opus`/`aac`)."""

    samples: Int16Array
    sample_rate: int
    format: str = "pcm"
    encoded: bytes = b""

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate if self.sample_rate else 0.0

    def to_float32(self) -> NDArray[np.float32]:
        """Samples scaled to [-1, 1)."""
        return self.samples.astype(np.float32) / np.float32(32768.0)

    def wav_bytes(self) -> bytes:
        """A complete 16-bit mono WAV file of the samples."""
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.sample_rate)
            w.writeframes(self.samples.astype("<i2").tobytes())
        return out.getvalue()

    def write_wav(self, path: str | Path) -> None:
        """Write the samples as a 16-bit mono WAV file. Raises `ValueError` for whole-file formats (write
        `encoded` instead)."""
        if not len(self.samples) and self.encoded:
            raise ValueError(f"{self.format} audio is kept encoded; write Audio.encoded to a .{self.format} file")
        Path(path).write_bytes(self.wav_bytes())
