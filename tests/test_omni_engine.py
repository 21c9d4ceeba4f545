"""The omni engine end to end on the CPU: vllm-omni's real Qwen3-TTS pipeline (talker and code2wav stages,
vLLM's CPU build, our CPU platform plugin) running tiny random-weight checkpoints, behind the real server,
driven over WebSocket and REST.

One engine start per checkpoint (about 60-90 s here), shared by the tests of that checkpoint: the fixture
is parametrized by checkpoint kind, so pytest runs each kind's tests together and stops its engine before
starting the next. Random weights never stop, so each unit's length is forced: `frames(text)` frames of
80 ms (1920 samples at 24 kHz); vllm-omni's code2wav returns the audio of all but the last frame.

Skipped, with the reason, where vllm-omni is not installed (the `omni-cpu` extra; CI installs it).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import os
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import numpy as np
import psutil
import pytest
import websockets
from safetensors import safe_open

pytest.importorskip("vllm_omni", reason="vllm-omni is not installed (extra omni-cpu, docs/engines.md)")

from transformers import AutoTokenizer
from voicewire.adapters import omni_compat
from voicewire.adapters.omni import (
    CPU_STAGE_CONFIGS,
    TASK_TYPES,
    OmniConfig,
    OmniEngine,
    _float_audio,
)
from voicewire.adapters.omni_testing import SPEAKERS, ModelKind, write_qwen3_tts
from voicewire.protocol.engine import SynthesisRequest, VoiceSample
from voicewire.protocol.media import decode_audio
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.vllm_omni_voices import write_audio_voice, write_embedding_voice
from tests.wsclient import Received, configure, recv_until, send

START_TIMEOUT_S = 400.0
RATE = 24000
FRAME = 1920
CONFIG = OmniConfig(model="", stage_config=str(CPU_STAGE_CONFIGS["qwen3_tts"]), random_weights=True)


def frames(text: str) -> int:
    return max(2, round(len(text) * CONFIG.frames_per_char))


def audio_samples_ok(samples: int, text: str) -> bool:
    """The forced length: all frames but the last (vllm-omni's code2wav), or all of them."""
    return (frames(text) - 1) * FRAME <= samples <= frames(text) * FRAME


@pytest.fixture(scope="module")
def omni_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    kind: ModelKind = request.param
    root = Path(tmp_path_factory.mktemp(f"omni_{kind}"))
    org, name = hf_name(kind).split("/")  # the folder as `hf download` leaves it in the hub cache
    model = write_qwen3_tts(root / "hub" / f"models--{org}--{name}" / "snapshots" / ("0a" * 20), kind)
    engine = OmniEngine(OmniConfig(model=str(model), stage_config=CONFIG.stage_config, random_weights=True,
                                   served_model_names=(SERVED_NAME,)))
    imported = None
    if kind == "base":  # the cloning checkpoint starts with a voice directory a vllm-omni server wrote
        imported = root / "vllm_omni_speakers"
        asyncio.run(upload_with_vllm_omni(imported, IMPORTED))
    server = ServerThread(Settings(engine="omni", max_units_in_flight=2, voices_dir=root / "voices",
                                   import_vllm_omni_voices=imported), engine, start_timeout_s=START_TIMEOUT_S)
    yield server
    server.stop()


SERVED_NAME: Final = "house-voice"
"""The engine's `--served-model-name`."""


def hf_name(kind: ModelKind) -> str:
    return f"Qwen/Qwen3-TTS-12Hz-0.6B-{TASK_TYPES[kind]}"


IMPORTED: Final = (("Alice", "consent-a", "The stored transcript."), ("Bob", "consent-b", None))
"""Voices uploaded to vllm-omni's speech server, imported at start: (name, consent, ref_text)."""


def vllm_omni_speech_writer(directory: Path) -> Any:
    """vllm-omni's own speech server object, only as far as its voice storage (`_init_speaker_storage`, which
    reads `$SPEAKER_SAMPLES_DIR`): its `upload_voice` and `upload_voice_embedding` need no model (with no
    model adapter, no built-in speaker names to refuse), so the files are exactly those a vllm-omni server
    writes."""
    from vllm_omni.entrypoints.openai.serving_speech import OmniOpenAIServingSpeech

    saved = os.environ.get("SPEAKER_SAMPLES_DIR")
    os.environ["SPEAKER_SAMPLES_DIR"] = str(directory)
    try:
        writer = object.__new__(OmniOpenAIServingSpeech)
        writer._adapter = None
        writer._init_speaker_storage()
    finally:
        if saved is None:
            del os.environ["SPEAKER_SAMPLES_DIR"]
        else:
            os.environ["SPEAKER_SAMPLES_DIR"] = saved
    return writer


async def upload_with_vllm_omni(directory: Path, voices: tuple[tuple[str, str, str | None], ...]) -> None:
    """Upload `voices` (2 s of 24 kHz WAV each) and one speaker-embedding voice, `Emb`, through vllm-omni."""
    from starlette.datastructures import Headers, UploadFile

    writer = vllm_omni_speech_writer(directory)
    for name, consent, ref_text in voices:
        sample = UploadFile(io.BytesIO(reference_wav(2.0)), filename=f"{name}.wav",
                            headers=Headers({"content-type": "audio/wav"}))
        await writer.upload_voice(sample, consent, name, ref_text=ref_text)
    await writer.upload_voice_embedding("[" + ", ".join(["0.5"] * 16) + "]", "consent-e", "Emb")


def kind(name: ModelKind) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("omni_server", [name], indirect=True)


def engine(server: ServerThread) -> OmniEngine:
    return server.engine_as(OmniEngine)


async def speak(server: ServerThread, text: str, **config: object) -> tuple[dict[str, object], bytes, Received]:
    """One utterance over the WebSocket as streamed 24 kHz pcm: (session.updated, audio bytes, all received)."""
    async with websockets.connect(server.ws_url) as ws:
        updated = await configure(ws, response_format="pcm", stream_audio=True, **config)
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done", timeout=300)
    audio = b"".join(i for i in got.items if isinstance(i, bytes))
    return updated, audio, got


async def post(server: ServerThread, path: str, **kwargs: object) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.http_url, timeout=300) as client:
        return await client.post(path, **kwargs)  # type: ignore[arg-type]


async def rest_wav(server: ServerThread, **body: object) -> tuple[int, int, httpx.Response]:
    response = await post(server, "/v1/audio/speech", json={"response_format": "wav", **body})
    if response.status_code != 200:
        return 0, 0, response
    with wave.open(io.BytesIO(response.content)) as w:  # a streamed WAV's header has no length: count the data
        return w.getframerate(), len(w.readframes(2**31 - 1)) // w.getsampwidth(), response


def reference_wav(seconds: float = 1.5) -> bytes:
    t = np.arange(int(RATE * seconds)) / RATE
    samples = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(samples.tobytes())
    return out.getvalue()


# -- CustomVoice --------------------------------------------------------------------------------------


@kind("custom_voice")
async def test_speakers_languages_and_rate_come_from_the_model(omni_server: ServerThread) -> None:
    text = "Hello there, speakers."
    updated, audio, got = await speak(omni_server, text, voice="Vivian", language="English")
    facts = updated["engine"]
    assert isinstance(facts, dict)
    assert facts["voices"] == list(SPEAKERS) and facts["default_voice"] == "vivian"
    assert facts["sample_rate"] == RATE and facts["word_timestamps"] is False and facts["voice_cloning"] is False
    assert "english" in facts["languages"] and "sichuan_dialect" in facts["languages"]
    assert updated["config"]["voice"] == "vivian"  # type: ignore[index]
    assert got.of("audio.done")[0]["error"] is False
    assert audio_samples_ok(len(audio) // 2, text), (len(audio) // 2, frames(text))
    assert np.abs(np.frombuffer(audio, np.int16)).max() > 0


@kind("custom_voice")
async def test_default_and_case_insensitive_speakers_over_rest(omni_server: ServerThread) -> None:
    text = "Speaking over REST now."
    for voice in ("default", "RYAN", "eric"):
        rate, samples, response = await rest_wav(omni_server, input=text, voice=voice, model="omni", stream=False)
        assert response.status_code == 200, response.text
        assert rate == RATE and audio_samples_ok(samples, text), (voice, samples)
        assert response.headers["x-vllm-omni-input-audio-tokens"] == "0"  # no reference audio fed


@kind("custom_voice")
async def test_fields_the_checkpoint_cannot_honour_are_refused_by_name(omni_server: ServerThread) -> None:
    async with websockets.connect(omni_server.ws_url) as ws:
        await send(ws, {"type": "session.config", "word_timestamps": True})
        got = await recv_until(ws, "error")
    assert got.of("error")[0]["param"] == "word_timestamps"
    for field, value in (("task_type", "Base"), ("ref_text", "hello"), ("voice", "nobody")):
        response = await post(omni_server, "/v1/audio/speech", json={"input": "Hi.", "voice": "vivian", field: value})
        assert response.status_code == 400, (field, response.text)
        assert response.json()["error"]["param"] == field


@kind("custom_voice")
async def test_the_model_is_named_as_vllm_omni_names_it_on_rest_and_websocket(omni_server: ServerThread) -> None:
    """`/v1/models` and `session.updated` publish, after the engine, the ids vllm-omni's server gives the
    model (its served name, the folder as given) and its HF-style name; each is accepted as `model`, on REST
    and on the WebSocket; a model not served is a 404 naming them."""
    hub = hf_name("custom_voice")
    ids = ["omni", SERVED_NAME, engine(omni_server).config.model, hub, "gpt-4o-mini-tts", "tts-1", "tts-1-hd"]
    async with httpx.AsyncClient(base_url=omni_server.http_url, timeout=300) as client:
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ids
        one = await client.get(f"/v1/models/{hub}")
        assert one.status_code == 200 and one.json()["id"] == hub, one.text
        assert (await client.get("/v1/models/Qwen/Qwen3-TTS-12Hz-1.7B-Base")).status_code == 404
    text = "Named by its hub name."
    rate, samples, response = await rest_wav(omni_server, input=text, model=hub)
    assert response.status_code == 200, response.text
    assert rate == RATE and audio_samples_ok(samples, text)
    refused = await post(omni_server, "/v1/audio/speech", json={"input": "Hi.", "model": "Qwen/Qwen3-TTS-Base"})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
    assert f"this server serves {', '.join(ids)}" in refused.json()["error"]["message"]
    updated, audio, _ = await speak(omni_server, text, model=hub)
    assert updated["config"]["model"] == hub and updated["engine"]["models"] == ids  # type: ignore[index]
    assert audio_samples_ok(len(audio) // 2, text)
    for name in ids[1:3]:
        async with websockets.connect(omni_server.ws_url) as ws:
            assert (await configure(ws, model=name))["config"]["model"] == name  # type: ignore[index]


@kind("custom_voice")
async def test_cancel_mid_unit_aborts_the_request_in_every_stage(omni_server: ServerThread) -> None:
    long_text = "This unit is long enough that both stages are still working when it is interrupted. " * 3
    async with websockets.connect(omni_server.ws_url) as ws:
        await configure(ws, response_format="pcm", stream_audio=True)
        await send(ws, {"type": "input.text", "text": long_text})
        await send(ws, {"type": "input.done"})
        await recv_until(ws, "audio.start", timeout=300)
        assert isinstance(await ws.recv(), bytes)
        await send(ws, {"type": "input.cancel"})
        cancelled = await recv_until(ws, "audio.cancelled")
        assert cancelled.of("audio.cancelled")
    async with asyncio.timeout(30):
        while engine(omni_server).requests_in_flight():
            await asyncio.sleep(0.1)
    # The pipeline is free: a following unit gets its whole audio.
    text = "After the cancel."
    _, audio, _ = await speak(omni_server, text)
    assert audio_samples_ok(len(audio) // 2, text)
    assert engine(omni_server).requests_in_flight() == 0


# -- vllm-omni's example WebSocket clients ------------------------------------------------------------
# The message sequences of vllm-omni's `examples/online_serving/text_to_speech/qwen3_tts/
# streaming_speech_client.py` and `token_level_streaming_client.py` with their defaults (their config
# fields and values, text in pieces then `input.done`, reading to `session.done`); our own texts. Both
# scripts were also run unchanged against a server like this one (docs/engines.md, "vllm-omni's clients").


@kind("custom_voice")
async def test_vllm_omnis_token_level_client_hears_audio_before_its_text_ends(omni_server: ServerThread) -> None:
    pieces = ("Good morning, ", "this text arrives ", "in small pieces ", "from a language model. ",
              "Its second sentence ", "ends the utterance.")
    units = ["Good morning, this text arrives in small pieces from a language model.",
             "Its second sentence ends the utterance."]
    async with websockets.connect(omni_server.ws_url, max_size=64 * 1024 * 1024) as ws:
        await send(ws, {"type": "session.config", "voice": "vivian", "streaming_mode": "token_level",
                        "response_format": "pcm"})
        for piece in pieces[:-1]:
            await send(ws, {"type": "input.text", "text": piece})
        got = await recv_until(ws, "audio.start", timeout=300)
        first = await ws.recv()  # audio of the first sentence, while the last piece is not sent yet
        assert isinstance(first, bytes) and first
        got.items.append(first)
        await send(ws, {"type": "input.text", "text": pieces[-1]})
        await send(ws, {"type": "input.done"})
        await recv_until(ws, "session.done", into=got, timeout=300)
    assert not got.of("error"), got.of("error")
    config = got.of("session.updated")[0]["config"]
    assert (config["split_granularity"], config["stream_audio"], config["voice"]) == ("sentence", True, "vivian")
    starts, dones = got.of("audio.start"), got.of("audio.done")
    assert [e["sentence_text"] for e in starts] == units
    assert all(e["sample_rate"] == RATE and e["format"] == "pcm" for e in starts)
    assert [e["error"] for e in dones] == [False, False]
    for text, done in zip(units, dones, strict=True):
        assert audio_samples_ok(done["total_bytes"] // 2, text), (text, done["total_bytes"])
    audio = b"".join(i for i in got.items if isinstance(i, bytes))
    assert len(audio) == sum(done["total_bytes"] for done in dones)
    assert got.of("session.done")[0]["total_sentences"] == 2


@kind("custom_voice")
async def test_vllm_omnis_streaming_client_defaults_get_one_wav_per_utterance(omni_server: ServerThread) -> None:
    text = "Hello from the streaming client. It sends the whole text at once."
    async with websockets.connect(omni_server.ws_url) as ws:
        await send(ws, {"type": "session.config", "speaker": "Vivian", "task_type": "CustomVoice",
                        "language": "Auto", "response_format": "wav", "speed": 1.0})
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done", timeout=300)
    assert not got.of("error"), got.of("error")
    [start], [done] = got.of("audio.start"), got.of("audio.done")
    assert (start["sentence_index"], start["sentence_text"], start["format"]) == (0, text, "wav")
    [wav] = [i for i in got.items if isinstance(i, bytes)]
    with wave.open(io.BytesIO(wav)) as w:
        assert w.getframerate() == RATE and audio_samples_ok(w.getnframes(), text)
    assert (done["sentence_index"], done["total_bytes"], done["error"]) == (0, len(wav), False)
    assert got.of("session.done")[0]["total_sentences"] == 1


STEADY_CHUNK = 25
"""`codec_chunk_frames` of the CPU stage config."""
SEAM_TOLERANCE = 1e-3
"""Largest sample difference allowed between paced chunks and one whole decode, relative to the whole
decode's swing (peak to peak). Measured: 6e-11 absolute, 6e-6 of the swing (float rounding: vllm-omni
0.30's code2wav carries its decoder state from chunk to chunk)."""


async def engine_chunks(server: ServerThread, request: SynthesisRequest) -> list[np.ndarray]:
    """The engine's audio pieces for one unit, one per vllm-omni chunk (run on the server's loop)."""
    async def run() -> list[np.ndarray]:
        return [piece.samples async for piece in engine(server).synthesize(request)]

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), server.loop))


async def whole_decode(server: ServerThread, request: SynthesisRequest) -> np.ndarray:
    """The same unit decoded by code2wav in one pass: vllm-omni's `full_utterance_decode` request flag
    holds every codec frame back until the talker is done."""
    async def run() -> np.ndarray:
        eng = engine(server)
        params = {**eng.parameters(request), "full_utterance_decode": [True]}
        prompt, _ = await eng._prompt(request, params)
        stream = omni_compat.generate(eng._omni, prompt, request.request_id,
                                      eng._sampling_params(request, params))
        pieces: list[np.ndarray] = []
        async for output in stream:
            audio = omni_compat.audio_of(output)
            if isinstance(audio, list):  # a growing list of every chunk so far
                pieces = [_float_audio(chunk) for chunk in audio]
            elif audio is not None:
                pieces.append(_float_audio(audio))
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), server.loop))


@kind("custom_voice")
async def test_chunks_are_paced_in_the_talker_stage_first_chunk_one_frame(omni_server: ServerThread) -> None:
    """The talker stage runs the pacer (`omni_pacing`): one stream leads by less than a frame, so its first
    chunk is vllm-omni's own single frame; the next is cut once the talker is far enough ahead, well before
    the stage config's 25 frames (so not its shipped 1-then-25); none is larger than the decoder's window."""
    text = "A longer unit, so that its chunks run past the first few and into full windows. " * 5
    chunks = await engine_chunks(omni_server, SynthesisRequest(request_id="paced-1", text=text, voice="vivian"))
    sizes = [len(c) / FRAME for c in chunks]
    assert audio_samples_ok(sum(map(len, chunks)), text), sizes
    assert all(n == int(n) and 1 <= n <= STEADY_CHUNK for n in sizes), sizes
    assert sizes[0] == 1 and sizes[1] < STEADY_CHUNK, sizes


@kind("custom_voice")
async def test_paced_chunks_equal_one_whole_decode(omni_server: ServerThread) -> None:
    text = "Every seam between paced chunks must be inaudible: the same samples as one whole decode. " * 2
    request = SynthesisRequest(request_id="seam-chunked", text=text, voice="ryan", seed=7)
    chunks = await engine_chunks(omni_server, request)
    whole = await whole_decode(omni_server, SynthesisRequest(request_id="seam-whole", text=text, voice="ryan",
                                                             seed=7))
    chunked = np.concatenate(chunks)
    assert len(chunks) > 2 and len(chunked) == len(whole) and audio_samples_ok(len(whole), text)
    swing = float(np.ptp(whole))
    assert swing > 0  # the decoder's output moves (tiny random weights: quiet, peak about 1e-3, swing 1e-5)
    error = float(np.abs(chunked - whole).max())
    assert error <= SEAM_TOLERANCE * swing, (error, swing)


@kind("custom_voice")
async def test_a_first_chunk_the_request_asks_for_is_honoured(omni_server: ServerThread) -> None:
    text = "A first chunk of four frames, as the request asks."
    chunks = await engine_chunks(omni_server, SynthesisRequest(request_id="first-4", text=text, voice="vivian",
                                                               initial_codec_chunk_frames=4))
    assert len(chunks[0]) == 4 * FRAME and audio_samples_ok(sum(map(len, chunks)), text)
    sentence = "Four frames come first."
    rate, samples, response = await rest_wav(omni_server, input=sentence, initial_codec_chunk_frames=4)
    assert response.status_code == 200, response.text
    assert rate == RATE and audio_samples_ok(samples, sentence)


@kind("custom_voice")
async def test_a_seeded_prompt_longer_than_a_cpu_step_is_spoken_whole(omni_server: ServerThread) -> None:
    """A seeded unit whose prompt passes the 512 tokens per step vllm-omni's CPU talker stage once had
    speaks, and the engine speaks on after it: chunked, its partial prefill rewound the seeded generator
    through an offset CPU generators lack and killed the stage (the CPU stage config prefills whole)."""
    text = " ".join(f"Line {n} of a long prompt." for n in range(120))
    tokenizer = AutoTokenizer.from_pretrained(engine(omni_server).config.model)
    assert len(tokenizer(text)["input_ids"]) > 512
    for request_id, words in (("long-seeded", text), ("after-long-seeded", "Still speaking.")):
        chunks = await engine_chunks(omni_server, SynthesisRequest(request_id=request_id, text=words,
                                                                   voice="vivian", seed=7, max_new_tokens=3))
        assert (3 - 1) * FRAME <= sum(map(len, chunks)) <= 3 * FRAME


# -- VoiceDesign --------------------------------------------------------------------------------------


@kind("voice_design")
async def test_voice_design_speaks_from_instructions(omni_server: ServerThread) -> None:
    text = "A designed voice speaks."
    updated, audio, _ = await speak(omni_server, text, task_type="VoiceDesign",
                                    instructions="A warm, low voice, speaking slowly.")
    assert updated["config"]["task_type"] == "VoiceDesign"  # type: ignore[index]
    assert audio_samples_ok(len(audio) // 2, text)
    rate, samples, response = await rest_wav(omni_server, input=text, instructions="A bright voice.")
    assert response.status_code == 200, response.text
    assert rate == RATE and audio_samples_ok(samples, text)


@kind("voice_design")
async def test_prompts_tokenized_off_the_loop_are_those_tokenized_on_it(omni_server: ServerThread) -> None:
    """Units build their prompts with texts tokenized in batches off the loop (`BatchEncoder`): for units asked
    for at once, the prompt length from vllm-omni's builder and the text tokens counted are what the model's
    tokenizer gives on the calling thread."""
    eng = engine(omni_server)
    requests = [SynthesisRequest(request_id=f"prompt-{index}", text=text, voice="default", task_type="VoiceDesign",
                                 instructions=instructions)
                for index, (text, instructions) in enumerate([
                    ("A designed voice speaks.", "A warm, low voice, speaking slowly."),
                    ("Numbers: 1,234.5 and 2026-12-06 stay text!", "A bright voice."),
                    ("Short.", "Whispered, close to the microphone, and very calm indeed.")])]

    async def built() -> list[tuple[int, int]]:
        prompts = await asyncio.gather(*(eng._prompt(r, eng.parameters(r)) for r in requests))
        return [(len(prompt["prompt_token_ids"]), text_tokens) for prompt, text_tokens in prompts]

    tokenizer = AutoTokenizer.from_pretrained(eng.config.model)
    on_thread = [(eng._prompt_len(eng.parameters(r), lambda text: tokenizer(text)["input_ids"]),
                  len(tokenizer(r.text)["input_ids"]) + len(tokenizer(r.instructions)["input_ids"]))
                 for r in requests]
    assert omni_server.call(built) == on_thread
    assert all(length > text_tokens > 0 for length, text_tokens in on_thread)


@kind("voice_design")
async def test_voice_design_without_instructions_is_an_error(omni_server: ServerThread) -> None:
    await nothing_spoken(omni_server, "No description given.")


async def nothing_spoken(omni_server: ServerThread, text: str) -> None:
    """`text` spoken with no voice source the checkpoint can use: an error, and no audio."""
    _, audio, got = await speak(omni_server, text)
    assert audio == b""
    assert got.of("error") or got.of("audio.done")[0]["error"] is True


# -- Base (cloning) -----------------------------------------------------------------------------------


@kind("base")
async def test_base_without_a_reference_is_an_error(omni_server: ServerThread) -> None:
    await nothing_spoken(omni_server, "Nothing to clone.")


@kind("base")
async def test_cloning_from_inline_ref_audio_and_x_vector_only(omni_server: ServerThread) -> None:
    text = "Cloned from a reference."
    data_url = "data:audio/wav;base64," + base64.b64encode(reference_wav()).decode()
    updated, audio, _ = await speak(omni_server, text, task_type="Base", ref_audio=data_url,
                                    ref_text="A short reference sentence.")
    assert updated["engine"]["voice_cloning"] is True  # type: ignore[index]
    assert audio_samples_ok(len(audio) // 2, text)
    rate, samples, response = await rest_wav(omni_server, input=text, task_type="Base", x_vector_only_mode=True,
                                       ref_audio=base64.b64encode(reference_wav()).decode())
    assert response.status_code == 200, response.text
    assert rate == RATE and audio_samples_ok(samples, text)


def reference_tokens(seconds: float) -> int:
    """Codec frames (12.5 per second) of a reference `seconds` long: what in-context cloning prefills."""
    return math.ceil(int(RATE * seconds) / RATE * 12.5)


@kind("base")
async def test_usage_counts_tokens_as_vllm_omni_does(omni_server: ServerThread) -> None:
    """vllm-omni's usage split, per unit (one engine request each): `text_tokens` the unit's text in the
    model's own text tokenizer, `output_tokens` the codec frames the talker generated (the forced length),
    `audio_tokens` the reference's codec frames in the prompt; x-vector-only cloning prefills none."""
    reference = base64.b64encode(reference_wav(1.5)).decode()
    fed = reference_tokens(1.5)
    request = SynthesisRequest(request_id="usage-probe", text="Hi.", voice="default", task_type="Base",
                               reference=VoiceSample.of(np.zeros(int(RATE * 1.5), np.float32), RATE),
                               ref_text="A short reference sentence.")
    assert engine(omni_server).parameters(request)["ref_code_length"] == [fed]  # what the prompt is built with
    text = "Cloned, and counted."
    clone = {"task_type": "Base", "ref_audio": reference, "ref_text": "A short reference sentence."}
    _, _, whole = await rest_wav(omni_server, input=text, stream=False, **clone)
    assert whole.status_code == 200, whole.text
    headers = whole.headers
    assert int(headers["x-vllm-omni-input-audio-tokens"]) == fed > 0
    assert int(headers["x-vllm-omni-input-tokens"]) == int(headers["x-vllm-omni-input-text-tokens"]) + fed
    two = "One sentence here. And a second one."
    sse = await post(omni_server, "/v1/audio/speech", json={"input": two, "stream_format": "sse",
                                                             "response_format": "pcm", **clone})
    assert sse.status_code == 200, sse.text
    done = json.loads([line for line in sse.text.splitlines() if line.startswith("data:")][-1][5:])
    assert done["type"] == "speech.audio.done"
    tokenizer = AutoTokenizer.from_pretrained(engine(omni_server).config.model)
    units = ("One sentence here.", "And a second one.")
    text_tokens = sum(len(tokenizer(unit)["input_ids"]) for unit in units)
    assert 0 < text_tokens != len(two)
    assert done["usage"] == {"input_tokens": text_tokens + 2 * fed, "output_tokens": sum(map(frames, units)),
                             "total_tokens": text_tokens + 2 * fed + sum(map(frames, units)),
                             "input_token_details": {"text_tokens": text_tokens, "audio_tokens": 2 * fed}}
    _, _, x_vector = await rest_wav(omni_server, input=text, stream=False, task_type="Base", ref_audio=reference,
                                    x_vector_only_mode=True)
    assert x_vector.status_code == 200, x_vector.text
    assert x_vector.headers["x-vllm-omni-input-audio-tokens"] == "0"


@kind("base")
async def test_a_reference_is_sent_once_then_named_by_its_artifact_key(omni_server: ServerThread) -> None:
    """Once a request that sent a reference has finished, the talker holds that reference's artifacts: the
    next request with it (from any client) sends vllm-omni's artifact key instead of the samples, as vllm-omni's
    own server does, and still clones in context (the same reference tokens, audio of the right length).
    The other cloning mode (x-vector only) is its own entry, sent whole until it has run once."""
    wav = reference_wav(1.8)  # a length no other test uses: a reference the talker has not seen
    decoded = decode_audio(wav, max_bytes=len(wav), max_seconds=10.0)  # the samples the server will have
    reference = VoiceSample.of(decoded.samples, decoded.sample_rate)
    in_context = SynthesisRequest(request_id="artifact-probe", text="Hi.", voice="default", task_type="Base",
                                  reference=reference, ref_text="A short reference sentence.")
    x_vector = SynthesisRequest(request_id="artifact-probe-x", text="Hi.", voice="default", task_type="Base",
                                reference=reference, x_vector_only_mode=True)
    before = engine(omni_server).parameters(in_context)
    key = before[omni_compat.QWEN3_TTS_REF_AUDIO_KEY]
    assert "ref_audio" in before
    clone = {"task_type": "Base", "ref_audio": base64.b64encode(wav).decode(),
             "ref_text": "A short reference sentence."}
    for attempt in ("first", "second"):
        text = f"The {attempt} clone of one reference."
        rate, samples, response = await rest_wav(omni_server, input=text, stream=False, **clone)
        assert response.status_code == 200, response.text
        assert rate == RATE and audio_samples_ok(samples, text)
        assert int(response.headers["x-vllm-omni-input-audio-tokens"]) == reference_tokens(1.8)
        after = engine(omni_server).parameters(in_context)
        assert "ref_audio" not in after and after[omni_compat.QWEN3_TTS_REF_AUDIO_KEY] == key
        assert after["ref_code_length"] == before["ref_code_length"]
    assert "ref_audio" in engine(omni_server).parameters(x_vector)


@kind("base")
async def test_cloning_an_uploaded_voice_by_name(omni_server: ServerThread) -> None:
    upload = await post(omni_server, "/v1/audio/voices",
                        files={"audio_sample": ("sample.wav", reference_wav(2.0), "audio/wav")},
                        data={"name": "narrator", "consent": "consent-1", "ref_text": "The stored transcript."})
    assert upload.status_code == 200, upload.text
    text = "An uploaded voice speaks."
    _, audio, _ = await speak(omni_server, text, voice="narrator")
    assert audio_samples_ok(len(audio) // 2, text)
    rate, samples, response = await rest_wav(omni_server, input=text, voice="narrator")
    assert response.status_code == 200, response.text
    assert rate == RATE and audio_samples_ok(samples, text)


@kind("base")
async def test_voices_imported_from_vllm_omni_clone_by_name_in_any_case(omni_server: ServerThread) -> None:
    async with httpx.AsyncClient(base_url=omni_server.http_url, timeout=60) as client:
        listed = {v["name"]: v for v in (await client.get("/v1/audio/voices")).json()["uploaded_voices"]}
    assert {(n, v["consent"], v.get("ref_text")) for n, v in listed.items() if n in ("Alice", "Bob")} == set(IMPORTED)
    assert listed["Alice"]["sample_rate"] == RATE and listed["Alice"]["duration_s"] == 2.0
    assert "Emb" not in listed  # a speaker-embedding voice is skipped (test_voice_import.py checks the reason)
    text = "An imported voice speaks."
    _, audio, got = await speak(omni_server, text, voice="alice")  # with its stored transcript
    assert not got.of("error") and audio_samples_ok(len(audio) // 2, text)
    rate, samples, response = await rest_wav(omni_server, input=text, voice="BOB")  # no transcript: x-vector only
    assert response.status_code == 200, response.text
    assert rate == RATE and audio_samples_ok(samples, text)


async def test_the_test_writer_writes_what_vllm_omnis_own_writer_writes(tmp_path: Path) -> None:
    """`tests/vllm_omni_voices` (used where vllm-omni is not installed) against vllm-omni's `upload_voice`."""
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    await upload_with_vllm_omni(theirs, (("Carol Ann", "consent/1", "Hello."),))
    [audio_file, embedding_file] = sorted(theirs.iterdir(), key=lambda p: p.name)
    with safe_open(str(audio_file), framework="numpy") as f:
        meta, audio = f.metadata(), f.get_tensor("audio")
    with safe_open(str(embedding_file), framework="numpy") as f:
        emb_meta = f.metadata()
    written = write_audio_voice(ours, "Carol Ann", audio, int(meta["sample_rate"]), created_at=int(meta["created_at"]),
                                consent="consent/1", ref_text="Hello.", filename="Carol Ann.wav",
                                file_size=int(meta["file_size"]))
    written_emb = write_embedding_voice(ours, "Emb", [0.5] * 16, created_at=int(emb_meta["created_at"]),
                                        consent="consent-e")
    assert (written.name, written_emb.name) == (audio_file.name, embedding_file.name)
    for mine, vllm_omnis in ((written, audio_file), (written_emb, embedding_file)):
        with safe_open(str(mine), framework="numpy") as a, safe_open(str(vllm_omnis), framework="numpy") as b:
            assert a.metadata() == b.metadata()
            assert list(a.keys()) == list(b.keys())
            for key in a.keys():
                assert np.array_equal(a.get_tensor(key), b.get_tensor(key)) and a.get_tensor(key).dtype == np.float32


@kind("base")
async def test_ref_audio_that_is_not_audio_is_refused_by_name_before_any_unit(omni_server: ServerThread) -> None:
    bad = "data:audio/wav;base64," + base64.b64encode(b"not audio at all " * 8).decode()
    good = "data:audio/wav;base64," + base64.b64encode(reference_wav()).decode()
    before = units_run(omni_server)
    response = await post(omni_server, "/v1/audio/speech", json={"input": "A bad reference.", "ref_audio": bad,
                                                                 "x_vector_only_mode": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "ref_audio" and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_audio" and "ref_audio" in error["message"]
    async with websockets.connect(omni_server.ws_url) as ws:
        await configure(ws, response_format="pcm", stream_audio=True, ref_audio=good, x_vector_only_mode=True)
        await send(ws, {"type": "session.config", "response_format": "pcm", "stream_audio": True,
                        "ref_audio": bad, "x_vector_only_mode": True})
        got = await recv_until(ws, "error")
        refused = got.of("error")[0]
        assert refused["code"] == "invalid_config" and refused["param"] == "ref_audio"
        assert refused["fatal"] is False and "ref_audio" in str(refused["message"])
        # With speaker_embedding, any ref_audio is refused for the pair (one voice source), before decoding it.
        await send(ws, {"type": "session.config", "ref_audio": bad, "speaker_embedding": [0.5] * 16})
        got = await recv_until(ws, "error")
        clash = got.of("error")[0]
        assert (clash["code"], clash["param"], clash["fatal"]) == ("invalid_config", "speaker_embedding", False)
        assert "ref_audio" in str(clash["message"])
        # The session keeps the config it had (the good reference) and speaks with it.
        text = "The good one still holds."
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        spoken = await recv_until(ws, "session.done", timeout=300)
    audio = b"".join(i for i in spoken.items if isinstance(i, bytes))
    assert not spoken.of("error") and audio_samples_ok(len(audio) // 2, text)
    assert units_run(omni_server) == before + 1  # only the good one: a refused reference runs no unit


def units_run(server: ServerThread) -> float:
    """`voicewire_units_total`, every outcome."""
    return sum(sample.value for metric in server.ctx.metrics.units.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


# -- An engine stage that dies ------------------------------------------------------------------------
# Keep this the last test of its checkpoint: it leaves that engine dead (the fixture's stop still runs).


def stage_process(stage: int) -> psutil.Process:
    """The engine-core process of vllm-omni stage `stage` (0: the talker, 1: code2wav) of this test's engine.
    Children that exit meanwhile or wait to be reaped (an earlier test's helper: a zombie's command line cannot be
    read) are not it."""
    [process] = [p for p in psutil.Process().children(recursive=True)
                 if f"StageEngineCoreProc_stage{stage}_" in " ".join(command_line(p))]
    return process


def command_line(process: psutil.Process) -> list[str]:
    """`process`'s command line; empty for a process that has exited or is a zombie."""
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # ZombieProcess is a NoSuchProcess
        return []


@kind("base")
async def test_a_talker_stage_that_dies_fails_the_work_in_flight_and_takes_the_server_out_of_rotation(
        omni_server: ServerThread) -> None:
    """The talker stage (0) dies while a cloning session speaks and a REST request is in flight."""
    reference = "data:audio/wav;base64," + base64.b64encode(reference_wav()).decode()
    await a_stage_dies(omni_server, 0, {"task_type": "Base", "ref_audio": reference, "x_vector_only_mode": True})


@kind("custom_voice")
async def test_a_code2wav_stage_that_dies_fails_the_work_in_flight_and_takes_the_server_out_of_rotation(
        omni_server: ServerThread) -> None:
    """The code2wav stage (1) dies while a session speaks and a REST request is in flight."""
    await a_stage_dies(omni_server, 1, {"voice": "serena"})


async def a_stage_dies(omni_server: ServerThread, stage: int, fields: dict[str, object]) -> None:
    """Stage `stage`'s process is killed while a session speaks and a REST request is in flight: each
    gets a typed engine failure, the server stays up and answers (nothing hangs), `/ready` and `/health`
    say the engine is down, new work is refused with a 503, and no request or session is left behind."""
    eng, ctx = engine(omni_server), omni_server.ctx
    long_text = "A unit long enough that both stages are still working when one of them goes away. " * 3
    label = f"Stage-{stage}"
    async with websockets.connect(omni_server.ws_url) as ws:
        await configure(ws, response_format="pcm", stream_audio=True, **fields)
        await send(ws, {"type": "input.text", "text": long_text})
        await send(ws, {"type": "input.done"})
        await recv_until(ws, "audio.start", timeout=300)
        assert isinstance(await ws.recv(), bytes)
        rest = asyncio.create_task(post(omni_server, "/v1/audio/speech", json={
            "input": long_text, "response_format": "wav", "stream": False, **fields}))
        async with asyncio.timeout(60):
            while eng.requests_in_flight() < 2:  # the REST unit reached the engine too
                await asyncio.sleep(0.05)
        process = stage_process(stage)
        process.kill()
        process.wait(30)
        got = await recv_until(ws, "session.done", timeout=120)
        errors = got.of("error")
        assert errors and all(e["code"] == "generation_failed" and e["fatal"] is False for e in errors), errors
        assert "pipeline is down" in errors[0]["message"] and label in errors[0]["message"]
        assert got.of("audio.done")[0]["error"] is True
        failed = await rest
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["code"] == "generation_failed"
        assert failed.json()["error"]["type"] == "server_error"
        # The session is still served: its next utterance fails at once with the same typed error.
        await send(ws, {"type": "input.text", "text": "Anyone there?"})
        await send(ws, {"type": "input.done"})
        again = await recv_until(ws, "session.done", timeout=60)
        assert [e["code"] for e in again.of("error")] == ["generation_failed"]
    async with httpx.AsyncClient(base_url=omni_server.http_url, timeout=30) as client:
        ready, health = await client.get("/ready"), await client.get("/health")
        refused = await client.post("/v1/audio/speech", json={"input": "Hello?", **fields})
    assert ready.status_code == 503 and label in ready.json()["reason"]
    assert health.status_code == 500 and label in health.json()["engine_error"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    with pytest.raises(websockets.InvalidStatus) as turned_away:
        async with websockets.connect(omni_server.ws_url):
            pass
    assert turned_away.value.response.status_code == 503
    async with asyncio.timeout(30):
        while eng.requests_in_flight() or ctx.sessions or ctx.scheduler.in_use:
            await asyncio.sleep(0.1)
