"""Audio format math: encodings against the G.711 reference, WAV headers, files, resampling, tempo, gain."""

from __future__ import annotations

import io
import struct
import wave
from collections.abc import Callable

import numpy as np
import pytest
import soundfile as sf
from numpy.typing import NDArray
from voicewire.protocol.audio import (
    CONTENT_TYPES,
    STREAMABLE_FORMATS,
    AudioFormat,
    RawFormat,
    StreamResampler,
    alaw_to_float,
    bytes_per_sample,
    codec_rate,
    encode_raw,
    float_to_alaw,
    float_to_mulaw,
    float_to_pcm16,
    mulaw_to_float,
    resample,
    time_stretch,
    wav_header,
)
from voicewire.protocol.encoders import make_encoder

from tests.rest_audio import decode

SR = 24000


def sine(freq: float, seconds: float, rate: int = SR, amplitude: float = 0.5) -> NDArray[np.float32]:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_frequency(x: NDArray[np.float32], rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate / len(x))


# --- G.711 reference, scalar, transcribed from the ITU-T G.711 reference code (g711.c) -----------------


def _search(value: int, table: list[int]) -> int:
    for i, end in enumerate(table):
        if value <= end:
            return i
    return len(table)


def ref_linear2ulaw(pcm: int) -> int:
    pcm >>= 2
    if pcm < 0:
        pcm, mask = -pcm, 0x7F
    else:
        mask = 0xFF
    pcm = min(pcm, 8159) + (0x84 >> 2)
    seg = _search(pcm, [0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
    if seg >= 8:
        return 0x7F ^ mask
    return ((seg << 4) | ((pcm >> (seg + 1)) & 0xF)) ^ mask


def ref_linear2alaw(pcm: int) -> int:
    pcm >>= 3
    if pcm >= 0:
        mask = 0xD5
    else:
        mask, pcm = 0x55, -pcm - 1
    seg = _search(pcm, [0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])
    if seg >= 8:
        return 0x7F ^ mask
    aval = seg << 4
    aval |= ((pcm >> 1) if seg < 2 else (pcm >> seg)) & 0xF
    return aval ^ mask


def ref_ulaw2linear(u: int) -> int:
    u = ~u & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return 0x84 - t if u & 0x80 else t - 0x84


def ref_alaw2linear(a: int) -> int:
    a ^= 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = t + 8 if seg == 0 else (t + 0x108) << (seg - 1) if seg > 1 else t + 0x108
    return t if a & 0x80 else -t


def floats_for_every_int16() -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """Float inputs that float_to_pcm16 maps onto each int16 value in [-32767, 32767]."""
    ints = np.arange(-32767, 32768, dtype=np.int64)
    return (ints / 32767.0).astype(np.float32), ints


# --- pcm16 ---------------------------------------------------------------------------------------------


def test_pcm16_is_little_endian_rounded_and_round_trips() -> None:
    x = np.array([0.0, 1.0, -1.0, 0.5, -0.25, 1e-5], dtype=np.float32)
    pcm = np.frombuffer(float_to_pcm16(x), dtype="<i2")
    assert pcm.tolist() == [0, 32767, -32767, 16384, -8192, 0]
    assert float_to_pcm16(np.array([1 / 32767], dtype=np.float32)) == b"\x01\x00"
    y = np.random.default_rng(0).uniform(-1, 1, 10_000).astype(np.float32)
    back = np.frombuffer(float_to_pcm16(y), dtype="<i2") / 32767.0
    assert np.max(np.abs(back - y)) <= 0.5 / 32767 + 1e-7


def test_pcm16_clips_instead_of_wrapping() -> None:
    x = np.array([1.5, -1.5, 100.0, -100.0], dtype=np.float32)
    assert np.frombuffer(float_to_pcm16(x), dtype="<i2").tolist() == [32767, -32767, 32767, -32767]


# --- G.711 ---------------------------------------------------------------------------------------------


def test_g711_known_values() -> None:
    silence = np.zeros(1, dtype=np.float32)
    assert float_to_mulaw(silence) == b"\xff"
    assert float_to_alaw(silence) == b"\xd5"
    assert float_to_mulaw(np.array([1.0, -1.0], dtype=np.float32)) == b"\x80\x00"
    assert float_to_alaw(np.array([1.0, -1.0], dtype=np.float32)) == b"\xaa\x2a"


def test_mulaw_is_bit_exact_with_reference_for_every_pcm16_value() -> None:
    x, ints = floats_for_every_int16()
    expected = bytes(ref_linear2ulaw(int(v)) for v in ints)
    assert float_to_mulaw(x) == expected


def test_alaw_is_bit_exact_with_reference_for_every_pcm16_value() -> None:
    x, ints = floats_for_every_int16()
    expected = bytes(ref_linear2alaw(int(v)) for v in ints)
    assert float_to_alaw(x) == expected


def test_g711_decoders_match_reference_for_every_code() -> None:
    codes = bytes(range(256))
    assert mulaw_to_float(codes).tolist() == [ref_ulaw2linear(c) / 32768 for c in codes]
    assert alaw_to_float(codes).tolist() == [ref_alaw2linear(c) / 32768 for c in codes]
    assert mulaw_to_float(codes).dtype == np.float32
    assert alaw_to_float(codes).dtype == np.float32


@pytest.mark.parametrize(
    ("encode", "decode"), [(float_to_mulaw, mulaw_to_float), (float_to_alaw, alaw_to_float)]
)
def test_g711_full_range_round_trip_error_is_bounded(
    encode: Callable[[NDArray[np.float32]], bytes], decode: Callable[[bytes], NDArray[np.float32]]
) -> None:
    x = np.linspace(-1, 1, 200_001, dtype=np.float32)
    error = np.abs(decode(encode(x)) - x)
    # Logarithmic companding: error grows with the value. A code covers up to 1/16 of its segment, and the
    # reference encoder's floor shift puts some values at a segment's bottom edge one step further away.
    small = np.abs(x) < 0.01
    assert np.max(error[small]) < 4e-4
    assert np.max(error[~small] / np.abs(x[~small])) < 0.06
    # Speech-level signal to quantisation noise of G.711: about 38 dB.
    tone = sine(440, 1.0)
    noise = decode(encode(tone)) - tone
    assert 10 * np.log10(np.mean(tone**2) / np.mean(noise**2)) > 35


def test_encode_raw_and_bytes_per_sample_agree() -> None:
    x = sine(440, 0.01)
    raw_formats: tuple[RawFormat, ...] = ("pcm", "mulaw", "alaw")
    for fmt in raw_formats:
        assert len(encode_raw(x, fmt)) == len(x) * bytes_per_sample(fmt)
    assert bytes_per_sample("wav") == 2
    assert encode_raw(x, "mulaw") == float_to_mulaw(x)
    with pytest.raises(ValueError):
        bytes_per_sample("mp3")
    assert STREAMABLE_FORMATS == {"pcm", "wav", "mulaw", "alaw"}
    assert set(CONTENT_TYPES) == {"pcm", "wav", "mulaw", "alaw", "flac", "mp3", "opus", "aac"}


# --- WAV header --------------------------------------------------------------------------------------


def test_sized_pcm_wav_header_parses_with_wave_module() -> None:
    x = sine(440, 0.1)
    pcm = float_to_pcm16(x)
    header = wav_header(SR, data_bytes=len(pcm))
    assert len(header) == 44
    with wave.open(io.BytesIO(header + pcm)) as w:
        assert w.getframerate() == SR
        assert w.getnchannels() == 1
        assert w.getsampwidth() == 2
        assert w.getnframes() == len(x)
        assert w.readframes(len(x)) == pcm
    assert struct.unpack("<I", header[4:8])[0] == 36 + len(pcm)


def test_streaming_pcm_wav_header_has_unknown_sizes() -> None:
    header = wav_header(16000, channels=2)
    assert header[:4] == b"RIFF" and header[8:12] == b"WAVE" and header[36:40] == b"data"
    assert struct.unpack("<I", header[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", header[40:44])[0] == 0xFFFFFFFF
    tag, channels, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", header[20:36])
    assert (tag, channels, rate, byte_rate, align, bits) == (1, 2, 16000, 64000, 4, 16)
    with wave.open(io.BytesIO(header + b"\x00" * 400)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 2, 2)


@pytest.mark.parametrize(("fmt", "tag", "subtype"), [("mulaw", 7, "ULAW"), ("alaw", 6, "ALAW")])
@pytest.mark.parametrize("n", [800, 801])
def test_g711_wav_header_parses_with_soundfile(fmt: RawFormat, tag: int, subtype: str, n: int) -> None:
    x = sine(300, n / 8000, rate=8000)
    data = encode_raw(x, fmt)
    header = wav_header(8000, fmt=fmt, data_bytes=len(data))
    assert len(header) == 58
    assert struct.unpack("<HH", header[20:24]) == (tag, 1)
    assert struct.unpack("<H", header[36:38])[0] == 0  # cbSize
    assert header[38:42] == b"fact" and struct.unpack("<I", header[46:50])[0] == n
    padded = header + data + b"\x00" * (len(data) % 2)
    assert struct.unpack("<I", header[4:8])[0] == len(padded) - 8
    info = sf.info(io.BytesIO(padded))
    assert (info.samplerate, info.channels, info.frames, info.subtype) == (8000, 1, n, subtype)
    decoded, rate = sf.read(io.BytesIO(padded), dtype="float32")
    reference = mulaw_to_float(data) if fmt == "mulaw" else alaw_to_float(data)
    assert rate == 8000
    np.testing.assert_allclose(decoded, reference, atol=1e-6)


@pytest.mark.parametrize("fmt", ["mulaw", "alaw", "pcm"])
def test_streaming_wav_header_is_readable_to_end(fmt: RawFormat) -> None:
    x = sine(300, 0.1, rate=8000)
    stream = wav_header(8000, fmt=fmt) + encode_raw(x, fmt)
    decoded, rate = sf.read(io.BytesIO(stream), dtype="float32")
    assert rate == 8000 and len(decoded) == len(x)


# --- whole files ---------------------------------------------------------------------------------------


def encode_file(x: NDArray[np.float32], rate: int, fmt: AudioFormat) -> bytes:
    """A whole signal as one file through the encoder family, at the rate the codec takes (`codec_rate`)."""
    out_rate = codec_rate(fmt, rate)
    encoder = make_encoder(fmt, out_rate, streaming=False)
    return encoder.encode(float_to_pcm16(resample(x, rate, out_rate))) + encoder.finish()


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
@pytest.mark.parametrize("rate", [24000, 16000, 22050, 44100])
def test_encode_file_decodes_with_right_rate_and_duration(fmt: AudioFormat, rate: int) -> None:
    x = sine(440, 1.0, rate=rate)
    decoded, out_rate = sf.read(io.BytesIO(encode_file(x, rate, fmt)), dtype="float32")
    if fmt == "opus":
        assert out_rate == {24000: 24000, 16000: 16000, 22050: 24000, 44100: 48000}[rate]
    else:
        assert out_rate == rate
    frame_tolerance = {"wav": 0, "flac": 0, "mp3": 2 * 1152, "opus": 2 * 960}[fmt]
    assert abs(len(decoded) / out_rate - 1.0) * out_rate <= frame_tolerance
    assert abs(peak_frequency(decoded, out_rate) - 440) < 5
    if fmt in ("wav", "flac"):
        np.testing.assert_allclose(decoded, x, atol=1 / 32767)


@pytest.mark.parametrize("rate", [24000, 16000, 9000])
def test_encode_file_aac_is_adts_at_an_mpeg_rate(rate: int) -> None:
    x = sine(440, 1.0, rate=rate)
    data = encode_file(x, rate, "aac")
    assert data[0] == 0xFF and data[1] & 0xF6 == 0xF0, "ADTS sync word"
    decoded, out_rate = decode(data, "aac")
    assert out_rate == {24000: 24000, 16000: 16000, 9000: 11025}[rate]
    assert abs(len(decoded) - out_rate) <= 3 * 1024  # priming and the padded last frame
    assert abs(peak_frequency(decoded, out_rate) - 440) < 5
    assert encode_file(np.zeros(0, np.float32), rate, "aac") == b""


def test_encode_file_raw_formats_equal_encode_raw() -> None:
    x = sine(440, 0.05)
    raw_formats: tuple[RawFormat, ...] = ("pcm", "mulaw", "alaw")
    for fmt in raw_formats:
        assert encode_file(x, SR, fmt) == encode_raw(x, fmt)


# --- resampling ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_rate", [8000, 16000, 44100, 48000])
def test_stream_resampler_chunked_matches_one_shot_with_exact_length(out_rate: int) -> None:
    rng = np.random.default_rng(out_rate)
    x = (sine(440, 1.0) + 0.1 * rng.standard_normal(SR)).astype(np.float32)
    x = x[: SR - 7]  # a length that does not divide evenly
    resampler = StreamResampler(SR, out_rate)
    pieces, pos = [], 0
    while pos < len(x):
        size = int(rng.integers(1, 2000))
        pieces.append(resampler.process(x[pos : pos + size]))
        pos += size
    pieces.append(resampler.process(np.zeros(0, dtype=np.float32), last=True))
    chunked = np.concatenate(pieces)
    expected_len = round(len(x) * out_rate / SR)
    one_shot = resample(x, SR, out_rate)
    assert len(chunked) == expected_len == len(one_shot)
    assert chunked.dtype == np.float32
    np.testing.assert_allclose(chunked, one_shot, atol=1e-4)


@pytest.mark.parametrize("out_rate", [8000, 16000, 44100, 48000])
def test_resampled_sine_keeps_its_frequency(out_rate: int) -> None:
    resampler = StreamResampler(SR, out_rate)
    x = sine(1000, 1.0)
    y = np.concatenate([resampler.process(x[:5000]), resampler.process(x[5000:], last=True)])
    assert abs(peak_frequency(y, out_rate) - 1000) < 2


def test_stream_resampler_is_reusable_after_last_and_exact_for_short_signals() -> None:
    resampler = StreamResampler(SR, 44100)
    for n in (1, 3, 100):
        out = resampler.process(np.ones(n, dtype=np.float32), last=True)
        assert len(out) == round(n * 44100 / SR)


def test_equal_rates_are_identity_without_copy() -> None:
    x = sine(440, 0.01)
    assert StreamResampler(SR, SR).process(x) is x
    assert resample(x, SR, SR) is x


# --- time stretch --------------------------------------------------------------------------------------


def harmonic(f0: float, seconds: float) -> NDArray[np.float32]:
    return sum(
        (sine(f0 * k, seconds, amplitude=0.4 / k) for k in range(1, 6)),
        start=np.zeros(round(seconds * SR), dtype=np.float32),
    )


@pytest.mark.parametrize("factor", [0.5, 0.8, 1.5, 2.0, 3.0])
def test_time_stretch_has_exact_length_and_keeps_pitch(factor: float) -> None:
    for signal, f0 in ((sine(220, 2.0), 220.0), (harmonic(150, 2.0), 150.0)):
        y = time_stretch(signal, SR, factor)
        assert len(y) == round(len(signal) / factor)
        assert y.dtype == np.float32
        assert abs(peak_frequency(y, SR) - f0) / f0 < 0.02
        # Level is preserved (no gaps or doubled overlaps).
        assert 0.8 < np.sqrt(np.mean(y**2)) / np.sqrt(np.mean(signal**2)) < 1.2


def test_time_stretch_identity_and_edge_lengths() -> None:
    x = sine(220, 0.5)
    assert time_stretch(x, SR, 1.0) is x
    assert len(time_stretch(x[:7], SR, 2.0)) == 4
    assert len(time_stretch(x[:0], SR, 1.5)) == 0
    with pytest.raises(ValueError):
        time_stretch(x, SR, 0.0)
