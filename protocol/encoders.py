"""The audio encoders, one family for the WebSocket and REST: 16-bit PCM in, a file format out, chunk by chunk.

Every encoder takes little-endian s16 mono PCM at its `sample_rate` (`protocol.audio.float_to_pcm16`)
through `encode(pcm)`, returns the bytes of the file that are ready now, and returns the rest from
`finish()`. Concatenating every return value gives one complete, decodable file. A WebSocket unit is
encoded by its `UnitRenderer` (one file per unit), a REST response by one encoder over all its units' PCM.

- `pcm`, `mulaw`, `alaw`: the samples themselves (G.711 bit-exact, `protocol.audio.encode_pcm16`).
- `wav`: a 44-byte header, then 16-bit samples. A streaming encoder writes the "unknown size" header
  (0xFFFFFFFF sizes, as OpenAI and vllm-omni stream WAV) before the first samples; a whole-file encoder
  holds the samples and writes the exact header in `finish()`.
- `mp3` (LAME), `opus` (libopus in Ogg, pages flushed every 20 ms of audio) and `aac` (FFmpeg's native
  AAC-LC in ADTS): PyAV's encoders, streaming. The codec holds a frame or two (about 25-60 ms) of audio
  between calls, so output trails input by that much until `finish()` drains it.
- `flac`: a whole file only, through libsndfile in `finish()`; FLAC's header holds the total length and
  a seek table, which a stream cannot know in advance.

Memory: the streaming encoders hold only their codec state; the whole-file ones (`flac`, whole `wav`)
hold the utterance's PCM until `finish()`, bounded by the REST input cap. Encoders are not thread-safe
and not reusable after `finish()`. Which rates each codec accepts is `codec_rate`'s business: the caller
renders at that rate so no encoder ever resamples.
"""

from __future__ import annotations

import io
from typing import Final, Literal, Protocol, cast, get_args

import av
import numpy as np
import soundfile as sf
from av.audio.stream import AudioStream
from av.container import OutputContainer
from voicewire.protocol.audio import CONTENT_TYPES, AudioFormat, RawFormat, codec_rate, encode_pcm16, wav_header

RestFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
REST_FORMATS: Final[tuple[str, ...]] = get_args(RestFormat)

REST_CONTENT_TYPES: Final[dict[str, str]] = {fmt: CONTENT_TYPES[fmt] for fmt in REST_FORMATS}

STREAMING_FORMATS: Final[frozenset[str]] = frozenset({"pcm", "wav", "mp3", "opus", "aac"})
"""Formats whose bytes can leave before the last sample is known."""

_PYAV: Final[dict[str, tuple[str, str, int]]] = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "aac": ("adts", "aac", 64_000),
}
"""Container, codec and bit rate per PyAV format: speech-grade mono rates (OpenAI's mp3 is 64-160 kb/s)."""

_OGG_PAGE_US: Final = "20000"


class StreamEncoder(Protocol):
    """Turns s16le mono PCM into one file of `format`; see the module docstring for the contract."""

    format: AudioFormat
    sample_rate: int

    def encode(self, pcm: bytes) -> bytes: ...

    def finish(self) -> bytes: ...

    def close(self) -> None:
        """Drop what is held without finishing the file (the response was abandoned); idempotent."""


class RawEncoder:
    """Headerless samples: s16 PCM passes through, `mulaw`/`alaw` are re-encoded sample by sample."""

    def __init__(self, fmt: RawFormat, sample_rate: int) -> None:
        self.format: AudioFormat = fmt
        self._raw = fmt
        self.sample_rate = sample_rate

    def encode(self, pcm: bytes) -> bytes:
        return encode_pcm16(pcm, self._raw)

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        return None


class WavEncoder:
    """WAV: streaming (unknown-size header first) or whole-file (exact header at `finish`)."""

    def __init__(self, sample_rate: int, *, streaming: bool) -> None:
        self.format: AudioFormat = "wav"
        self.sample_rate = sample_rate
        self._streaming = streaming
        self._header_sent = False
        self._held: list[bytes] = []

    def encode(self, pcm: bytes) -> bytes:
        if not self._streaming:
            self._held.append(pcm)
            return b""
        if self._header_sent:
            return pcm
        self._header_sent = True
        return wav_header(self.sample_rate) + pcm

    def finish(self) -> bytes:
        if self._streaming:
            return b"" if self._header_sent else wav_header(self.sample_rate)
        data = b"".join(self._held)
        self._held.clear()
        return wav_header(self.sample_rate, data_bytes=len(data)) + data

    def close(self) -> None:
        self._held.clear()


class FlacEncoder:
    """FLAC through libsndfile, as one whole file at `finish`."""

    def __init__(self, sample_rate: int) -> None:
        self.format: AudioFormat = "flac"
        self.sample_rate = sample_rate
        self._held: list[bytes] = []

    def encode(self, pcm: bytes) -> bytes:
        self._held.append(pcm)
        return b""

    def finish(self) -> bytes:
        samples = np.frombuffer(b"".join(self._held), "<i2")
        self._held.clear()
        buffer = io.BytesIO()
        sf.write(buffer, samples, self.sample_rate, format="FLAC", subtype="PCM_16")
        return buffer.getvalue()

    def close(self) -> None:
        self._held.clear()


class _Sink:
    """A write-only file for PyAV: no `seek`, so muxers write strictly in order; `take` drains it."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class PyAVEncoder:
    """mp3, opus (Ogg) or aac (ADTS) through PyAV/FFmpeg, streaming. `sample_rate` must be one
    `codec_rate` returns for the format. PyAV's frame adapter cuts input into the codec's frame size."""

    def __init__(self, fmt: Literal["mp3", "opus", "aac"], sample_rate: int) -> None:
        if codec_rate(fmt, sample_rate) != sample_rate:
            raise ValueError(f"{fmt} cannot code {sample_rate} Hz; use codec_rate()")
        self.format: AudioFormat = fmt
        self.sample_rate = sample_rate
        container_format, codec, bit_rate = _PYAV[fmt]
        self._sink = _Sink()
        options = {"page_duration": _OGG_PAGE_US} if container_format == "ogg" else {}
        self._container: OutputContainer = av.open(self._sink, mode="w", format=container_format,
                                                   options=options)
        self._stream = cast(AudioStream, self._container.add_stream(codec, rate=sample_rate, layout="mono"))
        self._stream.bit_rate = bit_rate
        self._pts = 0
        self._closed = False

    def encode(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, "<i2")
        if not len(samples):
            return b""
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += len(samples)
        self._container.mux(self._stream.encode(frame))
        return self._sink.take()

    def finish(self) -> bytes:
        if not self._closed:
            self._closed = True
            self._container.mux(self._stream.encode(None))
            self._container.close()
        return self._sink.take()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._container.close()


def make_encoder(fmt: AudioFormat, sample_rate: int, *, streaming: bool) -> StreamEncoder:
    """An encoder for `fmt` at `sample_rate` (already a `codec_rate`). `streaming=False` only changes
    `wav` (exact header); `flac` is always whole-file and the PyAV formats always stream."""
    if fmt == "pcm" or fmt == "mulaw" or fmt == "alaw":
        return RawEncoder(fmt, sample_rate)
    if fmt == "wav":
        return WavEncoder(sample_rate, streaming=streaming)
    if fmt == "flac":
        return FlacEncoder(sample_rate)
    return PyAVEncoder(fmt, sample_rate)
