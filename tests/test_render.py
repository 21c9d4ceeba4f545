"""UnitRenderer on the one encoder family: every WebSocket format renders a unit to a valid file, streamed or
whole, and the streamed sample formats equal the float encoders bit for bit."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
from voicewire.protocol.audio import STREAMABLE_FORMATS, AudioFormat, encode_raw, mulaw_to_float
from voicewire.protocol.engine import AudioPiece
from voicewire.protocol.render import RenderedPiece, RenderPlan, UnitRenderer

from tests.rest_audio import decode, tone

NATIVE = 24000


def render(fmt: AudioFormat, *, stream: bool, output_rate: int = NATIVE, pieces: int = 6) -> list[RenderedPiece]:
    renderer = UnitRenderer(RenderPlan(response_format=fmt, stream=stream, native_rate=NATIVE,
                                       output_rate=output_rate, engine_speed=1.0, stretch=1.0))
    audio = tone(1.0, NATIVE)
    out = [renderer.feed(AudioPiece(chunk, NATIVE)) for chunk in np.array_split(audio, pieces)]
    out.append(renderer.finish())
    assert renderer.output_bytes == sum(len(p.data) for p in out)
    return out


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac"])
def test_a_whole_unit_is_one_decodable_file_sent_at_finish(fmt: AudioFormat) -> None:
    out = render(fmt, stream=False, output_rate=16000)
    assert all(not p.data and not p.samples for p in out[:-1])
    audio, rate = decode(out[-1].data, fmt)
    assert rate == 16000 and out[-1].samples == 16000
    assert 1.0 - 0.001 <= len(audio) / rate < 1.0 + 0.1
    assert abs(float(audio.std()) - 0.3 / 2**0.5) < 0.05


@pytest.mark.parametrize("fmt", sorted(STREAMABLE_FORMATS))
def test_streamed_units_send_every_sample_as_it_comes(fmt: AudioFormat) -> None:
    out = render(fmt, stream=True)
    assert sum(p.samples for p in out) == NATIVE
    assert all(p.data for p in out[:-1])
    data = b"".join(p.data for p in out)
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"
        data = data[44:]
    expected = encode_raw(tone(1.0, NATIVE), "pcm" if fmt == "wav" else fmt)  # type: ignore[arg-type]
    assert data == expected
    if fmt == "mulaw":
        assert np.allclose(mulaw_to_float(data), tone(1.0, NATIVE), atol=0.01)


def test_every_websocket_format_is_covered() -> None:
    assert set(get_args(AudioFormat)) == {"wav", "flac", "mp3", "opus", "aac"} | STREAMABLE_FORMATS
