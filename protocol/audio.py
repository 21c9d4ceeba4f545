"""Audio format math: sample encodings, WAV headers, resampling and tempo (files: `protocol.encoders`).

Pure functions and one small stateful class, no I/O and no asyncio: the session runtime calls these on
every audio chunk, so everything is vectorised numpy.

Conventions shared by every function here:

- Samples are mono float32 in [-1.0, 1.0], as engines yield them. Values outside that range are clipped by
  the integer encoders, never wrapped.
- 16-bit PCM is little-endian signed, full scale 32767 (``round(x * 32767)``), so +1.0 and -1.0 map to
  +32767 and -32767 and a float -> pcm16 -> float trip is symmetric.
- G.711 mu-law and A-law are encoded from that 16-bit value with the reference segment algorithm of the
  ITU-T G.711 reference code (Sun's ``g711.c``), through a 65536-entry table built at import: bit-exact
  against it, one table lookup per sample.
- Decoders return float32 scaled by 1/32768.
"""

from __future__ import annotations

import struct
from typing import Final, Literal

import numpy as np
import soxr
from numpy.typing import NDArray
from voicewire.protocol.engine import FloatAudio

__all__ = [
    "CONTENT_TYPES",
    "STREAMABLE_FORMATS",
    "AudioFormat",
    "RawFormat",
    "StreamResampler",
    "alaw_to_float",
    "bytes_per_sample",
    "encode_pcm16",
    "encode_raw",
    "float_to_alaw",
    "float_to_mulaw",
    "float_to_pcm16",
    "mulaw_to_float",
    "resample",
    "time_stretch",
    "wav_header",
]

AudioFormat = Literal["pcm", "wav", "mulaw", "alaw", "flac", "mp3", "opus", "aac"]
RawFormat = Literal["pcm", "mulaw", "alaw"]

STREAMABLE_FORMATS: Final[frozenset[str]] = frozenset({"pcm", "wav", "mulaw", "alaw"})
"""Formats that can be sent chunk by chunk as they are synthesized (``wav`` with a streaming header)."""

CONTENT_TYPES: Final[dict[str, str]] = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}

_PCM16_SCALE: Final = 32767.0
_DECODE_SCALE: Final = np.float32(1.0 / 32768.0)
_RESAMPLE_QUALITY: Final = "HQ"

_MPEG_RATES: Final = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
CODEC_RATES: Final[dict[str, tuple[int, ...]]] = {
    "mp3": _MPEG_RATES,
    "aac": _MPEG_RATES,
    "opus": (8000, 12000, 16000, 24000, 48000),
}
"""Rates each lossy codec codes natively (within 8-48 kHz); the other formats take any rate."""


# --- sample encodings --------------------------------------------------------------------------------


def _to_int16(x: FloatAudio) -> NDArray[np.int16]:
    """round(clip(x, -1, 1) * 32767) as int16: one temporary, then in-place passes (hot path)."""
    scaled = np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0)
    scaled *= np.float32(_PCM16_SCALE)
    np.rint(scaled, out=scaled)
    pcm: NDArray[np.int16] = scaled.astype(np.int16)
    return pcm


def _build_mulaw_table() -> NDArray[np.uint8]:
    """mu-law byte for every int16 value, indexed by the value's uint16 bit pattern (G.711 reference)."""
    pcm = np.arange(65536, dtype=np.int64).astype(np.uint16).view(np.int16).astype(np.int64)
    val = pcm >> 2  # 14-bit magnitude domain; arithmetic shift like the reference code
    mask = np.where(val < 0, 0x7F, 0xFF)
    val = np.minimum(np.abs(val), 8159) + 33  # clip, then add the bias (0x84 >> 2)
    seg_end = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
    seg = np.searchsorted(seg_end, val, side="left")
    code = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | ((val >> (seg + 1)) & 0xF))
    table: NDArray[np.uint8] = (code ^ mask).astype(np.uint8)
    return table


def _build_alaw_table() -> NDArray[np.uint8]:
    """A-law byte for every int16 value, indexed by the value's uint16 bit pattern (G.711 reference)."""
    pcm = np.arange(65536, dtype=np.int64).astype(np.uint16).view(np.int16).astype(np.int64)
    val = pcm >> 3  # 13-bit domain
    mask = np.where(val >= 0, 0xD5, 0x55)
    val = np.where(val >= 0, val, -val - 1)
    seg_end = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])
    seg = np.searchsorted(seg_end, val, side="left")
    mantissa = np.where(seg < 2, val >> 1, val >> np.maximum(seg, 1)) & 0xF
    code = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | mantissa)
    table: NDArray[np.uint8] = (code ^ mask).astype(np.uint8)
    return table


def _build_mulaw_decode_table() -> FloatAudio:
    u = ~np.arange(256, dtype=np.int64) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    linear = np.where(u & 0x80, 0x84 - t, t - 0x84)
    return (linear * _DECODE_SCALE).astype(np.float32)


def _build_alaw_decode_table() -> FloatAudio:
    a = np.arange(256, dtype=np.int64) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    linear = np.where(a & 0x80, t, -t)
    return (linear * _DECODE_SCALE).astype(np.float32)


_MULAW_ENCODE: Final = _build_mulaw_table()
_ALAW_ENCODE: Final = _build_alaw_table()
_MULAW_DECODE: Final = _build_mulaw_decode_table()
_ALAW_DECODE: Final = _build_alaw_decode_table()


def float_to_pcm16(x: FloatAudio) -> bytes:
    """Little-endian signed 16-bit PCM, 2 bytes per sample: ``round(clip(x, -1, 1) * 32767)``."""
    return _to_int16(x).astype("<i2", copy=False).tobytes()


def float_to_mulaw(x: FloatAudio) -> bytes:
    """G.711 mu-law, 1 byte per sample, bit-exact with the reference encoder applied to ``float_to_pcm16``."""
    return _MULAW_ENCODE[_to_int16(x).view(np.uint16)].tobytes()


def float_to_alaw(x: FloatAudio) -> bytes:
    """G.711 A-law, 1 byte per sample, bit-exact with the reference encoder applied to ``float_to_pcm16``."""
    return _ALAW_ENCODE[_to_int16(x).view(np.uint16)].tobytes()


def mulaw_to_float(b: bytes) -> FloatAudio:
    """Decode G.711 mu-law bytes to float32 (reference decoder output / 32768), one sample per byte."""
    return _MULAW_DECODE[np.frombuffer(b, dtype=np.uint8)]


def alaw_to_float(b: bytes) -> FloatAudio:
    """Decode G.711 A-law bytes to float32 (reference decoder output / 32768), one sample per byte."""
    return _ALAW_DECODE[np.frombuffer(b, dtype=np.uint8)]


def encode_raw(x: FloatAudio, fmt: RawFormat) -> bytes:
    """Headerless samples in ``fmt``: one streamed chunk (``wav`` streams ``pcm`` after its header)."""
    if fmt == "pcm":
        return float_to_pcm16(x)
    if fmt == "mulaw":
        return float_to_mulaw(x)
    if fmt == "alaw":
        return float_to_alaw(x)
    raise ValueError(f"not a raw sample format: {fmt!r}")


def encode_pcm16(pcm: bytes, fmt: RawFormat) -> bytes:
    """`float_to_pcm16` output re-encoded as ``fmt``: the same bytes `encode_raw` gives for the float samples."""
    if fmt == "pcm":
        return pcm
    table = {"mulaw": _MULAW_ENCODE, "alaw": _ALAW_ENCODE}.get(fmt)
    if table is None:
        raise ValueError(f"not a raw sample format: {fmt!r}")
    return table[np.frombuffer(pcm, "<i2").view(np.uint16)].tobytes()


def bytes_per_sample(fmt: str) -> int:
    """Bytes per mono sample of a streamable format: 2 for ``pcm``/``wav``, 1 for ``mulaw``/``alaw``."""
    if fmt in ("pcm", "wav"):
        return 2
    if fmt in ("mulaw", "alaw"):
        return 1
    raise ValueError(f"{fmt!r} has no fixed sample size; streamable formats are {sorted(STREAMABLE_FORMATS)}")


# --- WAV ---------------------------------------------------------------------------------------------

_WAV_FORMAT_TAG: Final[dict[str, int]] = {"pcm": 1, "alaw": 6, "mulaw": 7}
_UNKNOWN_SIZE: Final = 0xFFFFFFFF


def wav_header(
    sample_rate: int,
    *,
    fmt: RawFormat = "pcm",
    channels: int = 1,
    data_bytes: int | None = None,
) -> bytes:
    """RIFF/WAVE header to put before ``encode_raw(..., fmt)`` samples.

    ``fmt`` picks the format tag: 1 (16-bit PCM, 44-byte header), 6 (8-bit A-law) or 7 (8-bit mu-law); the
    two G.711 tags get the 18-byte ``fmt `` chunk with ``cbSize = 0`` and the ``fact`` chunk (sample frames)
    that the WAVE spec requires of non-PCM formats, 58 bytes in all. The header always ends with the
    ``data`` chunk header, so the samples follow directly.

    ``data_bytes=None`` gives a streaming header: the RIFF size, the data size and the ``fact`` length are
    0xFFFFFFFF ("unknown, read to the end"), as streaming WAV players, OpenAI and vllm-omni use. With
    ``data_bytes`` set the sizes are exact; the RIFF size counts the pad byte that RIFF requires after an
    odd-length data chunk, so a caller writing an odd number of G.711 bytes appends ``b"\\x00"``.
    """
    if fmt not in _WAV_FORMAT_TAG:
        raise ValueError(f"WAV sample format must be one of {sorted(_WAV_FORMAT_TAG)}, got {fmt!r}")
    if sample_rate <= 0 or channels <= 0:
        raise ValueError("sample_rate and channels must be positive")
    sample_bytes = bytes_per_sample(fmt)
    block_align = channels * sample_bytes
    fmt_body = struct.pack(
        "<HHIIHH",
        _WAV_FORMAT_TAG[fmt],
        channels,
        sample_rate,
        sample_rate * block_align,
        block_align,
        8 * sample_bytes,
    )
    fact = b""
    if fmt != "pcm":
        fmt_body += struct.pack("<H", 0)  # cbSize
        frames = _UNKNOWN_SIZE if data_bytes is None else data_bytes // block_align
        fact = struct.pack("<4sII", b"fact", 4, frames)
    chunks = struct.pack("<4sI", b"fmt ", len(fmt_body)) + fmt_body + fact
    if data_bytes is None:
        riff_size = data_size = _UNKNOWN_SIZE
    elif data_bytes < 0:
        raise ValueError("data_bytes must be >= 0")
    else:
        data_size = data_bytes
        riff_size = 4 + len(chunks) + 8 + data_bytes + (data_bytes & 1)
    return (
        struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE") + chunks + struct.pack("<4sI", b"data", data_size)
    )


# --- codec rates -------------------------------------------------------------------------------------------


def codec_rate(fmt: str, requested: int) -> int:
    """The output sample rate of `fmt` for a requested rate: the requested rate when the codec takes it,
    else the next supported rate above it (the highest when none is above)."""
    rates = CODEC_RATES.get(fmt)
    if rates is None or requested in rates:
        return requested
    return next((r for r in rates if r >= requested), rates[-1])


# --- resampling ------------------------------------------------------------------------------------------


def _resampled_length(n_in: int, in_rate: int, out_rate: int) -> int:
    """``round(n_in * out_rate / in_rate)`` computed exactly (Python's round: halves to even)."""
    q, r = divmod(n_in * out_rate, in_rate)
    if 2 * r > in_rate or (2 * r == in_rate and q % 2 == 1):
        q += 1
    return q


def _fit_length(y: FloatAudio, length: int) -> FloatAudio:
    if len(y) >= length:
        return y[:length]
    return np.concatenate([y, np.zeros(length - len(y), dtype=np.float32)])


class StreamResampler:
    """Sample-rate conversion of one mono float32 stream fed in chunks (soxr, 'HQ' quality).

    Feed chunks in order with :meth:`process`; pass ``last=True`` with the final chunk (it may be empty)
    to flush the filter tail. Over one signal, the outputs add up to exactly
    ``round(total_in * out_rate / in_rate)`` samples: the flush pads or trims the tail to make that exact.
    Chunked output equals :func:`resample` of the whole signal up to floating-point noise. Output lags
    input by the filter delay (about 1 ms at 'HQ'), so early calls may return fewer samples, even none.
    After ``last=True`` the resampler is ready for a new signal. Memory is bounded by the filter state.
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError("sample rates must be positive")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=_RESAMPLE_QUALITY)
        )
        self._total_in = 0
        self._total_out = 0

    def process(self, x: FloatAudio, last: bool = False) -> FloatAudio:
        """Resample the next chunk; returns what is ready (float32, 1-D). Equal rates return ``x`` itself."""
        x = np.asarray(x, dtype=np.float32)
        if self._stream is None:
            return x
        y: FloatAudio = self._stream.resample_chunk(x, last=last)
        self._total_in += len(x)
        if not last:
            self._total_out += len(y)
            return y
        remaining = _resampled_length(self._total_in, self.in_rate, self.out_rate) - self._total_out
        self._stream.clear()
        self._total_in = self._total_out = 0
        return _fit_length(y, max(remaining, 0))


def resample(x: FloatAudio, in_rate: int, out_rate: int) -> FloatAudio:
    """One-shot resampling of a whole signal to exactly ``round(len(x) * out_rate / in_rate)`` samples."""
    x = np.asarray(x, dtype=np.float32)
    if in_rate == out_rate:
        return x
    y = np.asarray(soxr.resample(x, in_rate, out_rate, quality=_RESAMPLE_QUALITY), dtype=np.float32)
    return _fit_length(y, _resampled_length(len(x), in_rate, out_rate))


# --- tempo ---------------------------------------------------------------------------------------------

_WSOLA_FRAME_S: Final = 0.025


def time_stretch(x: FloatAudio, sample_rate: int, factor: float) -> FloatAudio:
    """Change tempo without changing pitch, by WSOLA (waveform-similarity overlap-add).

    ``factor`` > 1 speeds up (2.0 = half the duration), < 1 slows down. The output has exactly
    ``round(len(x) / factor)`` samples; ``factor == 1.0`` returns ``x`` itself.

    25 ms Hann frames are laid at a fixed 50% output hop; each frame is read from the input near its nominal
    position (output time * factor), shifted by up to a quarter frame (about +-6 ms: half the period of an
    80 Hz voice) to the position whose waveform best continues the previous frame (cross-correlation over
    the overlap). The search is sequential, one ``np.correlate`` of about (frame/2)^2 multiply-adds per
    12.5 ms output hop; the gather and overlap-add are vectorised. Runs a few hundred times realtime on
    24 kHz audio.
    """
    x = np.asarray(x, dtype=np.float32)
    if not np.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor must be a positive finite number, got {factor}")
    if factor == 1.0:
        return x
    n_out = round(len(x) / factor)
    if n_out == 0 or len(x) == 0:
        return np.zeros(n_out, dtype=np.float32)

    hop = max(1, round(_WSOLA_FRAME_S * sample_rate / 2))  # output hop = overlap length
    frame = 2 * hop
    tolerance = hop // 2
    analysis_hop = hop * factor
    # Frame k lands at output index k*hop - hop and is centred on output time k*hop, so every output sample
    # is covered by two frames whose periodic Hann windows add up to exactly 1.
    n_frames = -(-(n_out + hop) // hop) + 1
    front = hop + tolerance
    nominal = front - hop + np.rint(np.arange(n_frames) * analysis_hop).astype(np.int64)
    back = max(0, int(nominal[-1]) + tolerance + frame - (front + len(x)))
    padded = np.concatenate([np.zeros(front, dtype=np.float32), x, np.zeros(back, dtype=np.float32)])

    starts = nominal.copy()
    search = 2 * tolerance + hop
    for k in range(1, n_frames):
        continuation = padded[starts[k - 1] + hop : starts[k - 1] + frame]
        lo = int(nominal[k]) - tolerance
        similarity = np.correlate(padded[lo : lo + search], continuation, mode="valid")
        starts[k] = lo + int(np.argmax(similarity))

    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(frame) / frame)).astype(np.float32)
    frames = padded[starts[:, None] + np.arange(frame)] * window
    out = np.zeros((n_frames + 1) * hop, dtype=np.float32)
    even = frames[0::2].ravel()
    odd = frames[1::2].ravel()
    out[: len(even)] += even
    out[hop : hop + len(odd)] += odd
    return out[hop : hop + n_out]
