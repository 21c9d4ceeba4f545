"""A voice uploaded through the balancer is spoken with by sessions on every server, and once deleted through it,
refused by every server at once: `deploy/haproxy.cfg` in front of three voicewire servers (the cluster of
tests/test_balancer.py) on the `omni` engine with the tiny random-weight Qwen3-TTS Base checkpoint
(`adapters/omni_testing.py`: it clones from reference audio), sharing one voices directory.

The three servers start together and serve the whole module; each runs vllm-omni's two stages in processes of
their own (a stage process and its worker each), so this is the suite's heaviest cluster: 5-7 minutes to start
and 10 GiB at peak (proportional set size of the 20 processes) on two cores shared with a running CI suite.
Skipped, with the reason, where vllm-omni is not installed or haproxy is missing outside CI.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import subprocess
from collections.abc import Iterator
from typing import Final

import httpx
import pytest
import soundfile as sf

pytest.importorskip("vllm_omni", reason="vllm-omni is not installed (extra omni-cpu, docs/engines.md)")

from voicewire.adapters.omni import CPU_STAGE_CONFIGS
from voicewire.adapters.omni_testing import write_qwen3_tts

from tests.test_balancer import AUTH, Cluster, one_session_per_server, voice_refusal
from tests.test_balancer import pytestmark as needs_haproxy
from tests.test_omni_engine import RATE, audio_samples_ok, reference_tokens, reference_wav
from tests.wsclient import configure, utter

pytestmark = needs_haproxy

START_TIMEOUT_S: Final = 900.0
"""Three omni servers starting at once on two cores (one alone: 60-90 s, test_omni_engine.py)."""
VOICE: Final = "shared-narrator"
SAMPLE_S: Final = 2.0


@pytest.fixture(scope="module")
def omni_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("balancer_omni")
    model = write_qwen3_tts(root / "model", "base")
    running = Cluster(root, ("--engine", "omni", "--model", str(model), "--omni-random-weights",
                             "--stage-config", str(CPU_STAGE_CONFIGS["qwen3_tts"])))
    try:
        asyncio.run(running.all_up(START_TIMEOUT_S))
        yield running
    finally:
        # SIGTERM first: a server that shuts down stops its vllm-omni stage processes (SIGKILL would orphan them).
        for backend in running.backends.values():
            if backend.proc is not None and backend.running:
                backend.proc.send_signal(signal.SIGTERM)
        for backend in running.backends.values():
            if backend.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    backend.proc.wait(60)
        running.stop()


def decoded_wav(audio: bytes) -> tuple[int, int]:
    """(sample rate, samples) of one WAV file."""
    info = sf.info(io.BytesIO(audio))
    return info.samplerate, info.frames


async def test_a_voice_uploaded_through_the_balancer_is_spoken_with_on_every_server_then_deleted_everywhere(
        omni_cluster: Cluster) -> None:
    cluster = omni_cluster
    await cluster.all_up()
    async with (one_session_per_server(cluster) as held,
                httpx.AsyncClient(base_url=cluster.http_url, headers=AUTH, timeout=300) as client):
        # Sessions opened before the upload: each server finds the voice at its next lookup.
        uploaded = await client.post(
            "/v1/audio/voices", files={"audio_sample": ("narrator.wav", reference_wav(SAMPLE_S), "audio/wav")},
            data={"name": VOICE, "consent": "consent-on-file-9", "ref_text": "The stored transcript."})
        assert uploaded.status_code == 200, uploaded.text

        for server, ws in held.items():
            updated = await configure(ws, voice=VOICE, response_format="wav")
            assert updated["session_id"].startswith(f"{server}."), (server, updated["session_id"])
            assert updated["config"]["voice"] == VOICE and updated["config"]["task_type"] == "Base", server
            assert updated["engine"]["voice_cloning"] is True and updated["engine"]["sample_rate"] == RATE
            text = f"Server {server[-1]} speaks with the shared voice."
            got = await utter(ws, text, timeout=300)
            # The Base checkpoint has no voice of its own: audio at all means the uploaded sample was fed.
            assert not got.of("error") and [d["error"] for d in got.of("audio.done")] == [False], (server, got.types())
            rate, samples = decoded_wav(b"".join(i for i in got.items if isinstance(i, bytes)))
            assert rate == RATE and samples > 0 and audio_samples_ok(samples, text), (server, rate, samples)

            # The server's own account of the same voice over REST: the stored sample's codec frames were in
            # its prompt (vllm-omni's usage headers).
            backend = cluster.backends[server]
            spoken = await client.post(f"{backend.http_url}/v1/audio/speech",
                                       json={"input": text, "voice": VOICE, "response_format": "wav", "stream": False})
            assert spoken.status_code == 200, (server, spoken.text)
            assert int(spoken.headers["x-vllm-omni-input-audio-tokens"]) == reference_tokens(SAMPLE_S) > 0, server
            rate, samples = decoded_wav(spoken.content)
            assert rate == RATE and audio_samples_ok(samples, text), (server, rate, samples)

        deleted = await client.delete(f"/v1/audio/voices/{VOICE}")
        assert deleted.status_code == 200, deleted.text
        for server, ws in held.items():
            message = await voice_refusal(ws, VOICE)
            assert f"unknown voice '{VOICE}'" in message, (server, message)
        for backend in cluster.backends.values():
            refused = await client.post(f"{backend.http_url}/v1/audio/speech",
                                        json={"input": "Gone.", "voice": VOICE, "response_format": "wav"})
            assert refused.status_code == 400, (backend.name, refused.text)
            assert refused.json()["error"]["code"] == "voice_not_found", backend.name
    assert list(cluster.voices.iterdir()) == []
