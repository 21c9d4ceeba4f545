"""The omni engine with voicewire's own codec (`--omni-codec voicewire`): vllm-omni's real Qwen3-TTS talker
stage on the tiny random-weight Base (cloning) model (CPU), its frames sent over the frame channel
(`adapters/omni_frames.py`) and decoded by `Qwen3Codec` in the batcher, served over the real WebSocket.
Base covers both routes: x-vector-only cloning sends frames alone (as CustomVoice and VoiceDesign do), in-context
cloning sends the reference's codes first, as left context for the first windows."""

from __future__ import annotations

import asyncio
import base64
import io
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("vllm_omni", reason="vllm-omni is not installed (extra omni-cpu, docs/engines.md)")

from voicewire.adapters.omni import CPU_STAGE_CONFIGS, OmniConfig, OmniEngine, dummy_weights, kv_cache_pinned
from voicewire.adapters.omni_codec import QWEN3_POLICY
from voicewire.adapters.omni_testing import write_qwen3_tts
from voicewire.protocol.engine import SynthesisRequest, VoiceSample
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

FRAME = 1920
RATE = 24000
REF_TEXT = "A short reference sentence."
SEAM_TOLERANCE = 1e-4
"""Largest sample difference between chunked and whole decoding, as a fraction of the whole decode's swing."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = write_qwen3_tts(Path(tmp_path_factory.mktemp("own_codec")) / "model", "base")
    engine = OmniEngine(OmniConfig(model=str(model), stage_config=str(CPU_STAGE_CONFIGS["qwen3_tts"]),
                                   random_weights=True, pacing=None, own_codec=True))
    srv = ServerThread(Settings(engine="omni", max_units_in_flight=2), engine, start_timeout_s=400.0)
    yield srv
    srv.stop()


def frames_for(text: str) -> int:
    return max(2, round(len(text) * OmniConfig(model="").frames_per_char))


def reference(seconds: float) -> np.ndarray:
    """A reference recording: a 220 Hz tone, float32 at 24 kHz."""
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def wav_base64(samples: np.ndarray) -> str:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((samples * 32767).astype(np.int16).tobytes())
    return base64.b64encode(out.getvalue()).decode()


async def on_loop(server: ServerThread, request: SynthesisRequest
                  ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray | None]:
    """The engine's pieces for one unit, the frames its talker sent and the reference frames sent before them
    (None: none), run on the server's loop."""
    [result] = await together(server, [request])
    return result


async def together(server: ServerThread, requests: list[SynthesisRequest]
                   ) -> list[tuple[list[np.ndarray], np.ndarray, np.ndarray | None]]:
    """`on_loop` for units run at once, in the order of `requests`. Each unit's frames are found by their
    count (random-weight mode forces `frames_for(text) - 1`), so the texts must differ in that count."""
    engine = server.engine_as(OmniEngine)
    router = engine._router
    assert router is not None
    counts = [frames_for(r.text) - 1 for r in requests]
    assert len(set(counts)) == len(counts), "texts of distinct frame counts"

    async def pieces_of(request: SynthesisRequest) -> list[np.ndarray]:
        return [piece.samples async for piece in engine.synthesize(request)]

    async def run() -> list[tuple[list[np.ndarray], np.ndarray, np.ndarray | None]]:
        router.history, router.references = {}, {}
        try:
            pieces = await asyncio.gather(*(pieces_of(r) for r in requests))
            by_count = {len(frames): ticket for ticket, frames in router.history.items()}
            assert sorted(by_count) == sorted(counts), "one ticket per unit, with all its frames"
            return [(p, np.stack(router.history[by_count[n]]), router.references.get(by_count[n]))
                    for p, n in zip(pieces, counts, strict=True)]
        finally:
            router.history = None

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), server.loop))


def first_chunk_frames(server: ServerThread) -> int:
    """The frames the engine gives a unit's first chunk if one starts now (`FirstChunkSizer`: one on an idle
    pipeline; more where this machine's talker steps and codec latency have passed a frame's audio). Read
    between units, it is the one the next unit gets."""
    return server.engine_as(OmniEngine)._first_chunks.first_chunk_frames(QWEN3_POLICY.initial_frames)


def assert_seamless(chunked: np.ndarray, whole: np.ndarray) -> None:
    assert chunked.shape == whole.shape
    swing = float(np.ptp(whole))
    assert swing > 0
    assert float(np.abs(chunked - whole).max()) <= SEAM_TOLERANCE * swing


async def test_a_websocket_utterance_streams_every_frame_the_talker_made(server: ServerThread) -> None:
    text = "Frames decoded by our own codec, one chunk at a time."
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, response_format="pcm", stream_audio=True, task_type="Base",
                        ref_audio=wav_base64(reference(1.5)), ref_text=REF_TEXT)
        first = first_chunk_frames(server)  # before any of the text: no unit of this session runs yet
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done", timeout=300)
    chunks = [item for item in got.items if isinstance(item, bytes)]
    audio = np.frombuffer(b"".join(chunks), np.int16)
    assert len(chunks) > 1 and len(chunks[0]) == 2 * FRAME * first, "the first chunk: its 80 ms frames, pcm16"
    # the talker's frames: all forced frames but the last, as on vllm-omni's own path (test_omni_engine.py)
    assert len(audio) == (frames_for(text) - 1) * FRAME
    assert int(np.abs(audio).max()) > 0


async def test_rest_streams_the_units_audio_as_its_chunks_are_decoded(server: ServerThread) -> None:
    """`POST /v1/audio/speech` with `stream_format: "audio"` on the own codec: the body arrives in pieces as
    chunks are decoded (the first 80 ms frame before the rest), and holds every frame the talker made, pcm16."""
    text = "Spoken over REST by our own codec one chunk after another."  # one unit: no clause to speak first
    body = {"input": text, "response_format": "pcm", "stream_format": "audio", "task_type": "Base",
            "ref_audio": wav_base64(reference(1.5)), "x_vector_only_mode": True, "seed": 5}
    pieces: list[bytes] = []
    first = first_chunk_frames(server)
    async with (httpx.AsyncClient(base_url=server.http_url, timeout=300) as client,
                client.stream("POST", "/v1/audio/speech", json=body) as response):
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("audio/pcm")
        async for piece in response.aiter_raw():
            pieces.append(piece)
    audio = np.frombuffer(b"".join(pieces), np.int16)
    assert len(audio) == (frames_for(text) - 1) * FRAME
    assert len(pieces) > 1 and len(pieces[0]) <= 2 * FRAME * first, "streamed: the first chunk, then the rest"
    assert int(np.abs(audio).max()) > 0


async def test_chunks_equal_one_whole_decode_of_the_same_frames(server: ServerThread) -> None:
    """x-vector-only cloning: no reference codes, so the chunks equal a whole decode of the talker's frames."""
    text = "Every seam between chunks must be inaudible: the same samples as one whole decode. " * 2
    pieces, frames, ref = await on_loop(server, SynthesisRequest(
        request_id="own-seams", text=text, voice="default", task_type="Base", seed=7, x_vector_only_mode=True,
        reference=VoiceSample.of(reference(1.5), RATE)))
    assert ref is None
    assert len(frames) == frames_for(text) - 1 and len(pieces) > 3
    codec = server.engine_as(OmniEngine)._batcher.codec  # type: ignore[union-attr]
    assert_seamless(np.concatenate(pieces), codec.decode(frames[None])[0])


async def test_a_cloned_voice_decodes_after_its_reference_codes(server: ServerThread) -> None:
    """In-context cloning: the talker's reference codes (the last `codec_left_context_frames` of them, as
    vllm-omni bounds its first chunk's) reach the server before the first frame, and the unit's chunks equal
    the part after them of one whole decode of reference and frames, as vllm-omni's code2wav decodes it."""
    text = "A cloned voice continues from its reference without a seam. " * 2
    first = first_chunk_frames(server)
    pieces, frames, ref = await on_loop(server, SynthesisRequest(
        request_id="own-clone", text=text, voice="default", task_type="Base", seed=3, ref_text=REF_TEXT,
        reference=VoiceSample.of(reference(1.5), RATE)))
    assert ref is not None and ref.shape == (19, 16), "1.5 s of reference: 19 frames at 12.5 Hz"
    assert len(frames) == frames_for(text) - 1 and len(pieces) > 3 and len(pieces[0]) == FRAME * first
    codec = server.engine_as(OmniEngine)._batcher.codec  # type: ignore[union-attr]
    whole = codec.decode(np.concatenate([ref, frames])[None])[0, len(ref) * FRAME:]
    assert_seamless(np.concatenate(pieces), whole)
    alone = codec.decode(frames[None])[0]
    assert float(np.abs(alone[:FRAME] - whole[:FRAME]).max()) > SEAM_TOLERANCE * float(np.ptp(whole)), \
        "the reference changes the first frame's audio: it was decoded as context"


async def test_units_run_at_once_each_decode_their_own_frames(server: ServerThread) -> None:
    """Three units at once (the batcher decodes their windows together): each unit's chunks equal one whole
    decode of the frames its own talker request sent, none of another's."""
    texts = ["Three streams share the codec's batches.",
             "Each one must hear only its own frames, decoded in order.",
             "A third one, longer again, so that every stream has a length of its own."]
    results = await together(server, [
        SynthesisRequest(request_id=f"own-at-once-{i}", text=text, voice="default", task_type="Base", seed=11 + i,
                         x_vector_only_mode=True, reference=VoiceSample.of(reference(1.5), RATE))
        for i, text in enumerate(texts)])
    codec = server.engine_as(OmniEngine)._batcher.codec  # type: ignore[union-attr]
    for (pieces, frames, ref), text in zip(results, texts, strict=True):
        assert ref is None and len(frames) == frames_for(text) - 1
        assert_seamless(np.concatenate(pieces), codec.decode(frames[None])[0])


async def test_cancel_mid_unit_ends_its_request_and_frees_its_ticket(server: ServerThread) -> None:
    """`input.cancel` while the talker still sends frames: the unit's vllm-omni request ends in every stage, its
    frame ticket is released (later datagrams for it are dropped), and the next unit is spoken whole."""
    engine = server.engine_as(OmniEngine)
    long_text = "This unit is long enough that the talker is still sending frames when it is interrupted. " * 3
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, response_format="pcm", stream_audio=True, task_type="Base", x_vector_only_mode=True,
                        ref_audio=wav_base64(reference(1.5)))
        await send(ws, {"type": "input.text", "text": long_text})
        await send(ws, {"type": "input.done"})
        await recv_until(ws, "audio.start", timeout=300)
        assert isinstance(await ws.recv(), bytes)
        await send(ws, {"type": "input.cancel"})
        assert (await recv_until(ws, "audio.cancelled")).of("audio.cancelled")
        async with asyncio.timeout(60):
            while engine.requests_in_flight() or engine._router.claimed:  # type: ignore[union-attr]
                await asyncio.sleep(0.1)
        text = "After the cancel."
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done", timeout=300)
    assert not got.of("error"), got.of("error")
    audio = b"".join(item for item in got.items if isinstance(item, bytes))
    assert len(audio) // 2 == (frames_for(text) - 1) * FRAME
    assert engine.requests_in_flight() == 0 and engine._router.claimed == 0  # type: ignore[union-attr]


def codec_figures(server: ServerThread) -> dict[str, float]:
    response = httpx.get(server.http_url + "/metrics")
    assert response.status_code == 200
    return {s.name: s.value for family in text_string_to_metric_families(response.text) for s in family.samples
            if s.name.startswith("voicewire_codec_")}


async def test_metrics_count_the_codecs_work(server: ServerThread) -> None:
    """`GET /metrics` exports the codec path's figures, and they move by what one unit's chunks cost: one
    window per chunk, its frames with their left context, at least one decode call, no CUDA graph on a CPU; and
    one first chunk, its time split at the cut of its frames (both parts spent, together within the unit's)."""
    before = await asyncio.to_thread(codec_figures, server)
    text = "Counted by the codec's own figures."
    began = time.perf_counter()
    pieces, frames, _ = await on_loop(server, SynthesisRequest(
        request_id="own-metrics", text=text, voice="default", task_type="Base", x_vector_only_mode=True,
        reference=VoiceSample.of(reference(1.5), RATE)))
    took = time.perf_counter() - began
    after = await asyncio.to_thread(codec_figures, server)
    moved = {name: after[name] - before.get(name, 0.0) for name in after}
    assert moved["voicewire_codec_first_chunks_total"] == 1
    first_frames, first_decode = (moved[f"voicewire_codec_first_{part}_seconds_total"] for part in ("frames", "decode"))
    assert first_frames > 0 and first_decode > 0 and first_frames + first_decode < took
    assert moved["voicewire_codec_windows_total"] == len(pieces) > 1
    assert 1 <= moved["voicewire_codec_batches_total"] <= len(pieces)
    assert moved["voicewire_codec_frames_total"] >= len(frames)
    assert moved["voicewire_codec_decode_seconds_total"] > 0
    assert after["voicewire_codec_max_decode_seconds"] > 0
    assert after["voicewire_codec_cuda_graphs"] == 0 and after["voicewire_codec_fallbacks_total"] == 0


def test_settings_it_cannot_honour_are_refused_before_anything_starts(tmp_path: Path) -> None:
    base = write_qwen3_tts(tmp_path / "base", "base")
    with pytest.raises(ValueError, match="no pacing or ramp"):
        OmniConfig(model=str(base), own_codec=True)
    with pytest.raises(ValueError, match="no pacing or ramp"):
        OmniConfig(model=str(base), pacing=None, codec_chunk_ramp=(1, 2), own_codec=True)


def test_the_codec_takes_random_weights_where_the_pipeline_loads_none() -> None:
    """A deploy config with `load_format: dummy` (the duel's, on the H200) has no weights for the decoder to
    read either: voicewire's codec then runs on random weights, without the engine's random-weight mode (which
    would also force each unit's length)."""
    assert dummy_weights({"stages": [{"stage_id": 0, "load_format": "dummy"}, {"stage_id": 1}]})
    assert not dummy_weights({"stages": [{"stage_id": 0}, {"stage_id": 1, "load_format": "auto"}]})
    assert not dummy_weights({})


def test_the_codec_starts_beside_the_pipeline_only_where_every_stage_pins_its_kv_cache() -> None:
    """vLLM sizes an unpinned stage's KV cache from the GPU's free memory during its start, which the codec's
    graph capture in this process would upset; the CPU configs (and the duel's `--kv-cache-gib`) pin it."""
    from voicewire.adapters.omni_compat import resolved_deploy_config

    for path in CPU_STAGE_CONFIGS.values():
        assert kv_cache_pinned(resolved_deploy_config(path)), path
    pinned = {"stage_id": 0, "kv_cache_memory_bytes": 2**30}
    assert kv_cache_pinned({"stages": [pinned, {**pinned, "stage_id": 1}]})
    assert not kv_cache_pinned({"stages": [pinned, {"stage_id": 1, "gpu_memory_utilization": 0.2}]})
    assert not kv_cache_pinned({"stages": [pinned, {"stage_id": 1, "kv_cache_memory_bytes": 0}]})
    assert not kv_cache_pinned({})
