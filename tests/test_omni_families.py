"""vllm-omni's families besides Qwen3-TTS, end to end on the CPU: Fish Speech S2 Pro served by the omni
engine through vllm-omni 0.30.0's own Fish speech adapter (`tts_adapters/fish_speech.py`), its real
two-stage pipeline (slow AR, then the DAC decoder) on vLLM's CPU build, a tiny random-weight model folder
written by `adapters/omni_testing.py`, behind the real server, over WebSocket and REST.

One engine start (about 2-3 minutes here: the DAC decoder is built at full size), shared by every test.
The full-size random DAC decodes slowly on a CPU, so each surface gets one short unit: a plain one on the
WebSocket, a cloned one (inline `ref_audio` + `ref_text`) on REST. Random weights never
stop, so a unit's length is forced (`frames(text)` codec frames of `DAC_HOP_LENGTH` samples).

Skipped, with the reason, where vllm-omni is not installed (the `omni-cpu` extra; CI installs it).
"""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets

pytest.importorskip("vllm_omni", reason="vllm-omni is not installed (extra omni-cpu, docs/engines.md)")

from vllm_omni.model_executor.models.fish_speech.dac_utils import DAC_HOP_LENGTH, DAC_SAMPLE_RATE
from voicewire.adapters.omni import OmniConfig
from voicewire.adapters.omni_families import FAMILIES, OmniAdapterEngine, omni_engine
from voicewire.adapters.omni_testing import write_fish_s2_pro
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

START_TIMEOUT_S = 500.0
FISH = FAMILIES["fish_qwen3_omni"]
CONFIG = OmniConfig(model="", stage_config=str(FISH.cpu_stage_config), random_weights=True)


def frames(text: str) -> int:
    return max(2, round(len(text) * CONFIG.frames_per_char))


def audio_samples_ok(samples: int, text: str) -> bool:
    """The forced length, give or take one codec frame."""
    return (frames(text) - 1) * DAC_HOP_LENGTH <= samples <= (frames(text) + 1) * DAC_HOP_LENGTH


@pytest.fixture(scope="module")
def fish_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    root = Path(tmp_path_factory.mktemp("omni_fish"))
    engine = omni_engine(OmniConfig(model=str(write_fish_s2_pro(root / "model")), stage_config=CONFIG.stage_config,
                                    random_weights=True))
    assert isinstance(engine, OmniAdapterEngine)
    server = ServerThread(Settings(engine="omni", max_units_in_flight=2, voices_dir=root / "voices"), engine,
                          start_timeout_s=START_TIMEOUT_S)
    yield server
    server.stop()


def engine(server: ServerThread) -> OmniAdapterEngine:
    return server.engine_as(OmniAdapterEngine)


async def test_fish_streams_over_the_websocket_with_facts_from_the_model(fish_server: ServerThread) -> None:
    text = "Hello from a fish."
    async with websockets.connect(fish_server.ws_url) as ws:
        updated = await configure(ws, response_format="pcm", stream_audio=True, seed=3)
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done", timeout=300)
    facts = updated["engine"]
    assert isinstance(facts, dict)
    assert facts["sample_rate"] == DAC_SAMPLE_RATE  # learned from vllm-omni's audio at start
    assert facts["voices"] == ["default"] and facts["languages"] == ["auto"]
    assert facts["voice_cloning"] is True and facts["word_timestamps"] is False
    assert got.of("audio.done")[0]["error"] is False, got.items
    audio = b"".join(i for i in got.items if isinstance(i, bytes))
    assert audio_samples_ok(len(audio) // 2, text), (len(audio) // 2, frames(text))
    assert np.abs(np.frombuffer(audio, np.int16)).max() > 0
    assert engine(fish_server).requests_in_flight() == 0


async def test_fish_clones_over_rest_and_fields_its_adapter_cannot_honour_are_refused_by_name(
        fish_server: ServerThread) -> None:
    text = "A fish over REST."
    reference = base64.b64encode(reference_wav()).decode()
    async with httpx.AsyncClient(base_url=fish_server.http_url, timeout=300) as client:
        response = await client.post("/v1/audio/speech", json={
            "input": text, "response_format": "wav", "ref_audio": reference, "ref_text": "A short reference."})
        assert response.status_code == 200, response.text
        with wave.open(io.BytesIO(response.content)) as w:  # a streamed WAV's header has no length: count the data
            rate, samples = w.getframerate(), len(w.readframes(2**31 - 1)) // w.getsampwidth()
        assert rate == DAC_SAMPLE_RATE and audio_samples_ok(samples, text), (rate, samples)
        for field, value in (("instructions", "Calmly."), ("x_vector_only_mode", True), ("task_type", "Base"),
                             ("language", "English"), ("voice", "vivian")):
            refused = await client.post("/v1/audio/speech", json={"input": "Hi.", field: value})
            assert refused.status_code == 400, (field, refused.text)
            assert refused.json()["error"]["param"] == field, refused.text
    assert engine(fish_server).requests_in_flight() == 0


def reference_wav(seconds: float = 1.5, rate: int = 24000) -> bytes:
    """A sine tone as a 16-bit WAV (vllm-omni takes references of 1 to 30 s)."""
    t = np.arange(int(rate * seconds)) / rate
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16).tobytes())
    return out.getvalue()
