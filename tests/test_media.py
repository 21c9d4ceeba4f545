"""`protocol.media`: every accepted container decodes, everything else is refused before FFmpeg opens it,
the budgets hold while decoding, and a base64 `ref_audio` goes through the same gate."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable

import av
import numpy as np
import pytest
import soundfile as sf
from voicewire.protocol.encoders import make_encoder
from voicewire.protocol.media import (
    MAX_OUTPUT_RATE,
    MediaError,
    data_url_bytes,
    decode_audio,
    sniff_container,
)

from tests.rest_audio import pcm16, tone
from tests.test_upload_safety import HOSTILE, Loopback, flac_silence

SECONDS = 1.5
LIMITS = {"max_bytes": 10 * 2**20, "max_seconds": 30.0}


def soundfile_bytes(fmt: str, subtype: str, rate: int = 24000, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    audio = np.repeat(tone(SECONDS, rate)[:, None], channels, axis=1)
    sf.write(buffer, audio, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def encoder_bytes(fmt: str) -> bytes:
    encoder = make_encoder(fmt, 24000, streaming=True)
    return encoder.encode(pcm16(tone(SECONDS))) + encoder.finish()


def av_bytes(container: str, codec: str, rate: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        frame = av.AudioFrame.from_ndarray(pcm16_array(tone(SECONDS, rate))[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=rate)
        for piece in [*resampler.resample(frame), None]:
            for packet in stream.encode(piece):
                out.mux(packet)
    return buffer.getvalue()


def pcm16_array(x: np.ndarray) -> np.ndarray:
    return np.round(x * 32767).astype(np.int16)


ACCEPTED: dict[str, tuple[Callable[[], bytes], str]] = {
    "wav pcm16": (lambda: soundfile_bytes("WAV", "PCM_16"), "audio/wav"),
    "wav float stereo": (lambda: soundfile_bytes("WAV", "FLOAT", channels=2), "audio/wav"),
    "wav mu-law": (lambda: soundfile_bytes("WAV", "ULAW", rate=8000), "audio/wav"),
    "wav ima adpcm": (lambda: soundfile_bytes("WAV", "IMA_ADPCM"), "audio/wav"),
    "wav ms adpcm": (lambda: soundfile_bytes("WAV", "MS_ADPCM"), "audio/wav"),
    "wav gsm 6.10": (lambda: soundfile_bytes("WAV", "GSM610", rate=8000), "audio/wav"),
    "streamed wav (unknown length)": (lambda: encoder_bytes("wav"), "audio/wav"),
    "flac": (lambda: soundfile_bytes("FLAC", "PCM_16"), "audio/flac"),
    "ogg vorbis": (lambda: soundfile_bytes("OGG", "VORBIS"), "audio/ogg"),
    "ogg opus": (lambda: encoder_bytes("opus"), "audio/ogg"),
    "mp3 with an ID3 tag": (lambda: encoder_bytes("mp3"), "audio/mpeg"),
    "mp3 without a tag": (lambda: soundfile_bytes("MP3", "MPEG_LAYER_III"), "audio/mpeg"),
    "aac (adts)": (lambda: encoder_bytes("aac"), "audio/aac"),
    "m4a (aac in mp4)": (lambda: av_bytes("mp4", "aac", 24000), "audio/mp4"),
    "m4a (alac)": (lambda: av_bytes("mp4", "alac", 24000), "audio/mp4"),
    "webm (opus)": (lambda: av_bytes("webm", "libopus", 48000), "audio/webm"),
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_every_accepted_container_decodes_to_mono(case: str) -> None:
    make, mime = ACCEPTED[case]
    decoded = decode_audio(make(), **LIMITS)
    assert decoded.container.mime_type == mime
    assert decoded.samples.dtype == np.float32 and decoded.samples.ndim == 1
    assert decoded.duration_s == pytest.approx(SECONDS, abs=0.1)
    assert np.abs(decoded.samples).max() > 0.1


@pytest.mark.parametrize("data", [b"", b"hello", b"\x00" * 4096, b"#EXTM3U\n", b"ffconcat version 1.0\n",
                                  b"v=0\r\n", b"<?xml version='1.0'?><MPD/>", b"ID3\x04\x00\x00\x00\x00\x00\x00",
                                  b"RIFF\x00\x00\x00\x00AVI LIST", b"\xff\xff\xff\xff" * 8])
def test_anything_but_an_accepted_container_is_refused_unopened(data: bytes) -> None:
    assert sniff_container(data) is None
    with pytest.raises(MediaError) as caught:
        decode_audio(data, **LIMITS)
    assert caught.value.code == "invalid_audio"


def test_a_sniffed_container_that_does_not_parse_is_refused() -> None:
    with pytest.raises(MediaError) as caught:
        decode_audio(b"fLaC" + b"\x00" * 200, **LIMITS)
    assert caught.value.code == "invalid_audio" and "could not be decoded" in caught.value.message


def test_a_codec_outside_the_allowlist_is_refused_in_an_accepted_container() -> None:
    data = av_bytes("matroska", "ac3", 48000)
    assert sniff_container(data) is not None
    with pytest.raises(MediaError) as caught:
        decode_audio(data, **LIMITS)
    assert caught.value.code == "invalid_audio"


def test_decoding_stops_at_the_duration_cap_and_output_is_at_most_48k() -> None:
    with pytest.raises(MediaError) as caught:
        decode_audio(flac_silence(31.0, 8000, 1), **LIMITS)
    assert caught.value.code == "invalid_audio_duration"
    wide = decode_audio(flac_silence(2.0, 96_000, 2), **LIMITS)
    assert wide.sample_rate == MAX_OUTPUT_RATE and len(wide.samples) == pytest.approx(2 * MAX_OUTPUT_RATE, abs=64)


def test_decoding_stops_when_its_cpu_budget_is_spent() -> None:
    with pytest.raises(MediaError) as caught:
        decode_audio(flac_silence(20.0, 48_000, 1), **LIMITS, cpu_budget_s=0.0)
    assert caught.value.code == "invalid_audio" and "of CPU" in caught.value.message


def test_the_size_cap_is_checked_before_decoding() -> None:
    with pytest.raises(MediaError) as caught:
        decode_audio(b"RIFF" + b"\x00" * 100, max_bytes=50, max_seconds=30.0)
    assert caught.value.code == "upload_too_large"


@pytest.mark.parametrize("value", [
    "http://127.0.0.1:1/voice.wav", "file:///etc/passwd", "/etc/passwd", "voice.wav", "data:audio/wav,RIFF",
    "data:audio/wav;base64,@@@@", "",
])
def test_ref_audio_must_be_base64_data(value: str) -> None:
    with pytest.raises(MediaError) as caught:
        data_url_bytes(value, max_bytes=1024)
    assert caught.value.code == "invalid_audio"


def test_ref_audio_size_is_checked_before_base64_decoding() -> None:
    with pytest.raises(MediaError) as caught:
        data_url_bytes("data:audio/wav;base64," + "A" * 4096, max_bytes=1024)
    assert caught.value.code == "upload_too_large"


def test_base64_ref_audio_decodes_through_the_same_gate() -> None:
    wav = soundfile_bytes("WAV", "PCM_16")
    value = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    decoded = decode_audio(data_url_bytes(value, max_bytes=2**20), **LIMITS)
    assert decoded.duration_s == pytest.approx(SECONDS, abs=0.01)


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_ref_audio_opens_nothing(kind: str) -> None:
    with Loopback() as net:
        value = "data:audio/wav;base64," + base64.b64encode(HOSTILE[kind](net)).decode()
        with pytest.raises(MediaError) as caught:
            decode_audio(data_url_bytes(value, max_bytes=2**20), **LIMITS)
    assert caught.value.code == "invalid_audio"
    assert net.connections == 0 and not net.udp_bound
