"""The REST streaming encoders: every format decodes to the audio fed in, and the streaming ones stream."""

from __future__ import annotations

import struct

import pytest
from voicewire.protocol.audio import codec_rate
from voicewire.protocol.encoders import REST_FORMATS, STREAMING_FORMATS, make_encoder

from tests.rest_audio import decode, pcm16, tone

SECONDS = 1.5


def encode_in_pieces(fmt: str, rate: int, *, streaming: bool, pieces: int = 10) -> list[bytes]:
    pcm = pcm16(tone(SECONDS, rate))
    step = len(pcm) // pieces // 2 * 2
    encoder = make_encoder(fmt, rate, streaming=streaming)  # type: ignore[arg-type]
    out = [encoder.encode(pcm[i:i + step]) for i in range(0, len(pcm), step)]
    out.append(encoder.finish())
    return out


@pytest.mark.parametrize("fmt", REST_FORMATS)
def test_every_format_decodes_to_the_fed_duration_and_rate(fmt: str) -> None:
    data = b"".join(encode_in_pieces(fmt, 24000, streaming=True))
    audio, rate = decode(data, fmt)
    assert rate == 24000
    # Lossy codecs add encoder delay and pad the last frame: at most a few frames (< 100 ms) more.
    assert SECONDS - 0.001 <= len(audio) / rate < SECONDS + 0.1
    assert abs(float(audio.std()) - 0.3 / 2**0.5) < 0.05


@pytest.mark.parametrize("fmt", sorted(STREAMING_FORMATS))
def test_streaming_formats_emit_bytes_before_the_end(fmt: str) -> None:
    out = encode_in_pieces(fmt, 24000, streaming=True)
    before_finish = out[:-1]
    assert sum(1 for chunk in before_finish if chunk) >= len(before_finish) // 2
    assert sum(map(len, before_finish)) > sum(map(len, out)) // 2


def test_flac_is_a_whole_file_at_finish() -> None:
    out = encode_in_pieces("flac", 24000, streaming=True)
    assert not any(out[:-1])
    assert out[-1].startswith(b"fLaC")


def test_streamed_wav_has_an_unknown_size_header_and_whole_wav_an_exact_one() -> None:
    streamed = b"".join(encode_in_pieces("wav", 16000, streaming=True))
    riff, data_size = struct.unpack_from("<I", streamed, 4)[0], struct.unpack_from("<I", streamed, 40)[0]
    assert riff == data_size == 0xFFFFFFFF
    whole = encode_in_pieces("wav", 16000, streaming=False)
    assert not any(whole[:-1])
    assert struct.unpack_from("<I", whole[-1], 40)[0] == len(whole[-1]) - 44
    assert decode(whole[-1], "wav")[1] == 16000


@pytest.mark.parametrize(("fmt", "requested", "expected"), [
    ("opus", 22050, 24000), ("opus", 44100, 48000), ("opus", 16000, 16000),
    ("mp3", 22050, 22050), ("mp3", 9000, 11025), ("aac", 24000, 24000),
    ("pcm", 22222, 22222), ("wav", 8000, 8000), ("flac", 44100, 44100),
])
def test_codec_rate_keeps_supported_rates_and_rounds_up_the_rest(fmt: str, requested: int, expected: int) -> None:
    assert codec_rate(fmt, requested) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("rate", [8000, 16000, 48000])
def test_opus_decodes_at_the_rate_it_was_made_at(rate: int) -> None:
    audio, decoded_rate = decode(b"".join(encode_in_pieces("opus", rate, streaming=True)), "opus")
    assert decoded_rate == rate
    assert abs(len(audio) / rate - SECONDS) < 0.1


def test_an_unsupported_codec_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="codec_rate"):
        make_encoder("opus", 22050, streaming=True)
