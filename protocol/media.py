"""Decoding untrusted audio files (voice uploads, base64 `ref_audio`) safely, from memory, within bounds.

FFmpeg's demuxers include description formats that name other resources instead of holding audio: a
session description (SDP) makes the decoder bind UDP ports and wait for an RTP stream, a concat list or a
playlist (HLS, DASH) opens local files or URLs. Probing picks such a demuxer from the bytes alone, so an
upload could make the server open sockets or read its own files. This module is the one place where
client audio bytes are decoded, and it never probes:

- The container is sniffed from its magic bytes (`sniff_container`) against an allowlist (`CONTAINERS`:
  wav, flac, ogg, mp3, aac, m4a/mp4, webm/matroska); anything else is refused before FFmpeg sees it.
  The sniffed demuxer is then forced, and FFmpeg's `format_whitelist` holds only it.
- FFmpeg's `protocol_whitelist` is empty: no demuxer can open a file, a URL or a socket (a nested open
  fails), and the input itself is read only from the given bytes, through a `BytesIO`.
- Only the first audio stream is decoded, and only with an allowlisted decoder (`codec_whitelist` also
  binds the stream probing FFmpeg does while opening).
- Budgets, enforced while decoding (each decoded frame is checked before it is kept, so a small file that
  expands into hours of audio stops after `max_seconds`, never after decoding it all): input size
  (`max_bytes`), decoded duration (`max_seconds`), input sample rate (`MAX_INPUT_RATE`), channels
  (`MAX_CHANNELS`), and the CPU time of the decoding thread (`DECODE_CPU_BUDGET_S`). The result is mono
  float32 at the input's rate or `MAX_OUTPUT_RATE`, whichever is lower (resampled while decoding), so it
  holds at most `max_seconds * MAX_OUTPUT_RATE` samples: 5.8 MB at 30 s.

Memory: the input bytes, FFmpeg's per-frame buffers (a frame is at most tens of thousands of samples), and
the mono output. Blocking and CPU-bound: call it from a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from dataclasses import dataclass
from typing import Final

import av
import numpy as np
from av.audio.resampler import AudioResampler
from voicewire.protocol.engine import FloatAudio

__all__ = [
    "ACCEPTED",
    "CONTAINERS",
    "DECODE_CPU_BUDGET_S",
    "MAX_CHANNELS",
    "MAX_INPUT_RATE",
    "MAX_OUTPUT_RATE",
    "Container",
    "DecodedAudio",
    "MediaError",
    "data_url_bytes",
    "decode_audio",
    "sniff_container",
]

MAX_INPUT_RATE: Final = 192_000
"""Highest sample rate an input may declare (studio rates pass; a 655 kHz 'bomb' does not)."""
MAX_CHANNELS: Final = 8
"""Most channels an input may have (7.1); they are mixed down to mono while decoding."""
MAX_OUTPUT_RATE: Final = 48_000
"""Decoded audio above this rate is resampled down to it while decoding."""
DECODE_CPU_BUDGET_S: Final = 10.0
"""CPU seconds one decode may use (its thread's time, so a busy machine does not shorten it)."""


@dataclass(frozen=True, slots=True)
class Container:
    """An accepted container: its public `name`, the FFmpeg demuxer forced for it, and its media type."""

    name: str
    demuxer: str
    mime_type: str


CONTAINERS: Final = (
    Container("wav", "wav", "audio/wav"),
    Container("flac", "flac", "audio/flac"),
    Container("ogg", "ogg", "audio/ogg"),
    Container("mp3", "mp3", "audio/mpeg"),
    Container("aac", "aac", "audio/aac"),
    Container("m4a", "mov,mp4,m4a,3gp,3g2,mj2", "audio/mp4"),
    Container("webm", "matroska,webm", "audio/webm"),
)
_BY_NAME: Final = {c.name: c for c in CONTAINERS}
ACCEPTED: Final = ", ".join(c.name for c in CONTAINERS)

_DECODERS: Final = frozenset({"flac", "vorbis", "opus", "mp3float", "mp3", "aac", "aac_fixed", "alac",
                               "adpcm_ima_wav", "adpcm_ms", "gsm_ms"})
"""Decoders allowed besides the PCM family (`pcm_*`, which covers mu-law and A-law); the last three are
the compressed WAV codings that voice recorders write."""
_CODEC_WHITELIST: Final = ",".join(sorted(
    name for name in av.codecs_available if name in _DECODERS or name.startswith("pcm_")))
_PROBE_BYTES: Final = 32 * 1024
"""How much input FFmpeg may read and decode while opening, to learn the stream's parameters (its
default, 5 MB, meant decoding most uploads twice, once of them unbounded by our checks)."""
_OPTIONS_BASE: Final = {"protocol_whitelist": "", "codec_whitelist": _CODEC_WHITELIST,
                        "probesize": str(_PROBE_BYTES)}


class MediaError(Exception):
    """Refused audio: a stable `code` (`invalid_audio`, `invalid_audio_duration`, `upload_too_large`)
    and a message completing "<field> ..." (the caller names the field)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    """Mono float32 samples, their rate, and the container they came in."""

    samples: FloatAudio
    sample_rate: int
    container: Container

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


def sniff_container(data: bytes) -> Container | None:
    """The accepted container `data` starts as, by its magic bytes, or None. An ID3v2 tag in front (as
    mp3 files, and some flac and aac files, carry) is skipped first."""
    head = data[_id3_length(data):]
    if head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE":
        return _BY_NAME["wav"]
    if head[:4] == b"fLaC":
        return _BY_NAME["flac"]
    if head[:4] == b"OggS":
        return _BY_NAME["ogg"]
    if head[4:8] == b"ftyp":
        return _BY_NAME["m4a"]
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return _BY_NAME["webm"]
    if len(head) >= 4 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        layer = (head[1] >> 1) & 0b11
        if layer == 0b00 and head[1] & 0xF6 == 0xF0:  # MPEG-2/4 ADTS: 12-bit sync, layer 0
            return _BY_NAME["aac"]
        if layer != 0b00 and head[1] & 0x18 != 0x08 and head[2] >> 4 != 0xF:  # MPEG audio frame header
            return _BY_NAME["mp3"]
    return None


def _id3_length(data: bytes) -> int:
    if data[:3] != b"ID3" or len(data) < 10 or any(b & 0x80 for b in data[6:10]):
        return 0
    size = (data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9]
    footer = 10 if data[5] & 0x10 else 0
    return 10 + size + footer


def decode_audio(data: bytes, *, max_bytes: int, max_seconds: float,
                 cpu_budget_s: float = DECODE_CPU_BUDGET_S) -> DecodedAudio:
    """Decode one untrusted audio file held in memory to mono float32 (see the module docstring for what
    is accepted and every bound), or raise `MediaError`. Opens nothing but `data`."""
    if len(data) > max_bytes:
        raise MediaError("upload_too_large", f"is larger than {max_bytes} bytes")
    container = sniff_container(data)
    if container is None:
        raise _not_audio()
    try:
        return _decode(data, container, max_seconds, cpu_budget_s)
    except (av.FFmpegError, ValueError, OverflowError):
        raise _not_audio() from None


def _decode(data: bytes, container: Container, max_seconds: float, cpu_budget_s: float) -> DecodedAudio:
    cpu_deadline = time.thread_time() + cpu_budget_s
    options = {**_OPTIONS_BASE, "format_whitelist": container.demuxer}
    with av.open(io.BytesIO(data), mode="r", format=container.demuxer, container_options=options,
                 metadata_errors="ignore") as source:
        if not source.streams.audio:
            raise _not_audio()
        stream = source.streams.audio[0]
        if stream.codec_context.codec.name not in _CODEC_WHITELIST.split(","):
            raise _not_audio()
        out_rate = min(int(stream.rate or 0), MAX_OUTPUT_RATE)
        if out_rate <= 0:
            raise _not_audio()
        resampler = AudioResampler(format="flt", layout="mono", rate=out_rate)
        parts: list[FloatAudio] = []
        seconds = 0.0
        for packet in source.demux(stream):
            if time.thread_time() > cpu_deadline:
                raise MediaError("invalid_audio", f"took more than {cpu_budget_s:g} s of CPU to decode")
            for frame in stream.decode(packet):
                _check_frame(frame.sample_rate, frame.layout.nb_channels)
                seconds += frame.samples / frame.sample_rate
                if seconds > max_seconds:
                    raise _too_long(max_seconds)
                parts.extend(_mono(out) for out in resampler.resample(frame))
        parts.extend(_mono(out) for out in resampler.resample(None))
    samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if not len(samples):
        raise _not_audio()
    return DecodedAudio(samples, out_rate, container)


def _check_frame(rate: int, channels: int) -> None:
    if not 0 < rate <= MAX_INPUT_RATE:
        raise MediaError("invalid_audio", f"has a sample rate of {rate} Hz (accepted: up to {MAX_INPUT_RATE} Hz)")
    if not 0 < channels <= MAX_CHANNELS:
        raise MediaError("invalid_audio", f"has {channels} channels (accepted: 1 to {MAX_CHANNELS})")


def _mono(frame: av.AudioFrame) -> FloatAudio:
    return np.asarray(frame.to_ndarray(), dtype=np.float32).reshape(-1)


def data_url_bytes(value: str, *, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URL (`data:[<type>][;...];base64,<payload>`), or raise `MediaError`.

    Any other scheme is refused: a URL or path is never fetched or opened. The payload's size is checked
    before it is decoded, so a huge string costs no decoding.
    """
    header, sep, payload = value.partition(",")
    if not sep or not header.lower().startswith("data:") or not header.lower().endswith(";base64"):
        raise MediaError("invalid_audio", "must be base64 audio in a data: URL (data:audio/wav;base64,...); "
                         "URLs and paths are never fetched")
    if len(payload) // 4 * 3 > max_bytes:
        raise MediaError("upload_too_large", f"is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise MediaError("invalid_audio", "is not valid base64") from None


def _not_audio() -> MediaError:
    return MediaError("invalid_audio", f"could not be decoded as audio (accepted: {ACCEPTED})")


def _too_long(limit: float) -> MediaError:
    return MediaError("invalid_audio_duration", f"is longer than {limit:g} s")
