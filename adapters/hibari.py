"""The embedded CPU engine: hibari-tts 0.2.1 (24 kHz English, weights inside its wheel, no network).

One request runs as a short sequence of jobs on the engine's own thread pool (`workers` threads, one
onnxruntime session bound to each thread): a planning job (sentence split, G2P, word alignment), then one
job per phoneme chunk (the model, then the host DSP). Each chunk yields one `AudioPiece`; the next chunk's
job is submitted before the current piece is yielded, so a multi-sentence unit keeps its worker busy while
the consumer writes audio.

Word timings come from the model's per-phoneme durations: the bundled graph computes them internally
(`/Cast_32_output_0`, one integer per phoneme id, in 600-sample units, summing exactly to the audio
length); `start()` exposes that tensor as an extra graph output, in memory.

Cancel: closing the iterator or cancelling its consumer sets `RunOptions.terminate` on the model run in
flight, so onnxruntime abandons it at the next node and the worker thread is free within milliseconds; a
terminated job skips its DSP. The DSP of a chunk (about a quarter of its compute) is not interruptible.

Memory per request: the unit's phoneme strings and at most two chunks of audio (one being yielded, one
being computed); a chunk holds at most 400 phonemes, about 25 s of audio (2.4 MB of float32).

Text cost: hibari's G2P reads a run of characters without whitespace as one word made of sub-tokens and
tries every span of them against its lexicon, cubic in their number ("ab-ab-ab-...", 84 pieces, took
seconds), and its number reader fails past 36 digits. So the engine splits every such run longer than
`MAX_TOKEN_CHARS` (after a hyphen, slash or other non-alphanumeric character when it can, else hard) before
G2P sees it; word spans still index the text as sent.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import re
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from voicewire.adapters.base import RequestCounts, counted_outcome
from voicewire.adapters.registry import HIBARI
from voicewire.protocol.engine import (
    AudioPiece,
    EngineCapabilities,
    EngineInfo,
    FloatAudio,
    SynthesisRequest,
    WordSpan,
)

SAMPLE_RATE = 24000
SPEED_RANGE = (0.5, 2.0)
DURATION_TENSOR = "/Cast_32_output_0"
"""Per-phoneme-id durations inside the bundled graph (int64, one per id, in `DURATION_UNIT` samples)."""
DURATION_UNIT = 600

_PAUSE_SYMBOLS = frozenset(';:,.!?—…"()“”')
"""Phoneme-alphabet punctuation: pauses, not speech; a word's span ends before them."""
_EDGE_PUNCTUATION = "\"'\u201c\u201d\u2018\u2019()[]{}<>«»,.;:!?…\u2014\u2013-*_"
"""Stripped from both ends of a written word's char range ("U.S." -> "U.S", "'hi,'" -> "hi")."""
_WARMUP_TEXT = "Warm up the voicewire engine, please."
_PHONEME_WORD = re.compile(r"[^ ]+")
_TEXT_WORD = re.compile(r"\S+")
_LIMIT_CEILING = 0.98
_LIMIT_KNEE = 0.8
MAX_TOKEN_CHARS = 32
"""Longest run without whitespace G2P reads as one word: longer than English words, short enough that
the cubic sub-token search stays in the milliseconds and a digit run stays within the number reader."""
_LONG_TOKEN = re.compile(rf"\S{{{MAX_TOKEN_CHARS + 1},}}")


class _G2P(Protocol):
    def __call__(self, text: str) -> str: ...


class _Hibari(Protocol):
    """The parts of `hibari.Hibari` this engine uses (hibari ships no type hints)."""

    model_path: str
    vocab: dict[str, int]

    @property
    def g2p(self) -> _G2P: ...

    def split_sentences(self, text: str) -> list[str]: ...

    def phonemize(self, text: str) -> list[str]: ...

    def ids(self, phonemes: str) -> list[int]: ...


_Synth = Callable[..., FloatAudio]


@dataclass(frozen=True, slots=True)
class HibariStats(RequestCounts):
    """A snapshot of the engine's counters since `start()`.

    Requests by outcome as `RequestCounts` says (`completed` also when there was nothing to say).
    `runs_in_flight` is the number of chunk jobs executing in worker threads right now. The seconds are
    summed over finished chunk jobs: model (onnxruntime) time, host DSP time, and audio produced.
    """

    runs_in_flight: int = 0
    model_seconds: float = 0.0
    dsp_seconds: float = 0.0
    audio_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One model call: a phoneme string's ids and, for each of its phoneme words (space-separated runs
    holding speech), the id indices of the first and last speech symbol and the number of speech symbols
    (pause punctuation excluded)."""

    ids: tuple[int, ...]
    word_ids: tuple[tuple[int, int], ...]
    word_sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _PlannedWord:
    """A written word and the (chunk, phoneme word) positions of its first and last phoneme words."""

    char_start: int
    char_end: int
    first: tuple[int, int]
    last: tuple[int, int]


@dataclass(frozen=True, slots=True)
class _Plan:
    chunks: tuple[_Chunk, ...]
    words: tuple[_PlannedWord, ...]


@dataclass(frozen=True, slots=True)
class _Rendered:
    samples: FloatAudio
    durations: npt.NDArray[np.int64]
    word_samples: tuple[tuple[int, int], ...]
    """Per phoneme word of the chunk: (first sample, end sample) relative to the chunk's audio."""


def offered_voices() -> tuple[str, ...]:
    """Voices whose model is inside the hibari wheel: the only ones this engine offers (no downloads)."""
    from hibari.voices import VOICES

    registry = cast(dict[str, dict[str, object]], VOICES)
    return tuple(name for name, entry in registry.items() if entry.get("bundled"))


def _text_words(text: str, start: int, end: int) -> list[tuple[int, int, str]]:
    """Written words of text[start:end]: (char_start, char_end, raw word), the range without edge
    punctuation unless the word is punctuation only."""
    words = []
    for match in _TEXT_WORD.finditer(text, start, end):
        raw = match.group()
        stripped = raw.strip(_EDGE_PUNCTUATION)
        if stripped:
            lead = len(raw) - len(raw.lstrip(_EDGE_PUNCTUATION))
            words.append((match.start() + lead, match.start() + lead + len(stripped), raw))
        else:
            words.append((match.start(), match.end(), raw))
    return words


def phonemizer_text(text: str) -> tuple[str, list[int] | None]:
    """`text` as G2P gets it: every run without whitespace longer than `MAX_TOKEN_CHARS` cut into pieces of
    at most that many characters by inserted spaces, each cut after the last non-alphanumeric character in
    the second half of its piece when there is one. Also, for each character of the result, its index in
    `text` (an inserted space gets the index of the character before it); None when nothing was cut."""
    if _LONG_TOKEN.search(text) is None:
        return text, None
    pieces: list[str] = []
    origin: list[int] = []
    done = 0
    for match in _LONG_TOKEN.finditer(text):
        pieces.append(text[done : match.start()])
        origin.extend(range(done, match.start()))
        start, end = match.span()
        while start < end:
            cut = min(start + MAX_TOKEN_CHARS, end)
            if cut < end:
                joint = next((i + 1 for i in range(cut - 1, start + MAX_TOKEN_CHARS // 2 - 1, -1)
                              if not text[i].isalnum()), cut)
                cut = joint
            if start > match.start():
                pieces.append(" ")
                origin.append(start - 1)
            pieces.append(text[start:cut])
            origin.extend(range(start, cut))
            start = cut
        done = end
    pieces.append(text[done:])
    origin.extend(range(done, len(text)))
    return "".join(pieces), origin


def _soft_limit(samples: FloatAudio, gain: float) -> FloatAudio:
    """Apply `gain`, then bend samples above the knee smoothly towards the ceiling (memoryless, so every
    piece is levelled the same way and no state crosses piece boundaries)."""
    out = samples * np.float32(gain)
    over = np.abs(out) > _LIMIT_KNEE
    if over.any():
        room = _LIMIT_CEILING - _LIMIT_KNEE
        bent = _LIMIT_KNEE + room * np.tanh((np.abs(out[over]) - _LIMIT_KNEE) / room)
        out[over] = np.copysign(bent, out[over]).astype(np.float32)
    return out


class HibariEngine:
    """hibari-tts behind the voicewire `Engine` interface.

    `workers` threads compute at most `workers` requests at once (`info.max_concurrency`); each thread
    runs one single-threaded onnxruntime session. `gain_db` lifts hibari's level (about 6 dB below
    typical engines) with a soft limiter that keeps peaks under 0.98.

    Word spans: each written word (a whitespace-separated run, edge punctuation stripped from its char
    range) is matched to the phoneme words G2P made of it; its span runs from its first phoneme to the end
    of its last speech phoneme (a trailing comma's pause is not part of the word). Words that produce no
    speech phonemes (a lone "-", "...") get no span.
    """

    def __init__(self, workers: int = 1, voice: str = "heart", gain_db: float = 6.0) -> None:
        if workers < 1:
            raise ValueError(f"hibari: workers must be at least 1, got {workers}")
        voices = offered_voices()
        if voice not in voices:
            raise ValueError(f"hibari: unknown voice {voice!r}; available: {', '.join(voices)}")
        self._workers = workers
        self._voice = voice
        self._gain = float(10.0 ** (gain_db / 20.0))
        self._info = EngineInfo(
            name="hibari",
            sample_rate=SAMPLE_RATE,
            voices=(voice,),
            default_voice=voice,
            languages=("en",),
            capabilities=EngineCapabilities(
                word_timings=HIBARI.word_timings,
                voice_cloning=False,
                speed_range=SPEED_RANGE,
                streaming="unit",
                fields=HIBARI.fields,
                values=HIBARI.values,
            ),
            max_concurrency=workers,
        )
        self._executor: ThreadPoolExecutor | None = None
        self._tts: _Hibari | None = None
        self._synth: _Synth | None = None
        self._idle_sessions: list[ort.InferenceSession] = []
        self._thread_state = threading.local()
        self._g2p_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._stats = HibariStats()
        self._word_phonemes = functools.lru_cache(maxsize=8192)(self._g2p_word)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def stats(self) -> HibariStats:
        with self._stats_lock:
            return self._stats

    async def start(self) -> None:
        """Load the model and G2P and warm every worker thread; blocking work runs off the event loop."""
        if self._executor is not None:
            return
        executor = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="hibari")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(executor, self._load)
            barrier = threading.Barrier(self._workers)
            warmups = [
                loop.run_in_executor(executor, self._warm_worker, barrier) for _ in range(self._workers)
            ]
            await asyncio.gather(*warmups)
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        self._executor = executor
        self._stats = HibariStats()

    async def close(self) -> None:
        """Stop the worker threads (after their current job) and drop the sessions."""
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
        self._idle_sessions.clear()
        self._tts = None

    def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        return self._synthesize(request)

    async def render_phonemes(
        self, phonemes: str, *, speed: float = 1.0, seed: int | None = None
    ) -> tuple[FloatAudio, npt.NDArray[np.int64]]:
        """Synthesize one phoneme string (hibari's alphabet) on a worker: the levelled audio and the
        per-id durations in `DURATION_UNIT` samples (pads included; `durations.sum() * 600 == len(audio)`)."""
        ids = tuple(self._require_tts().ids(phonemes))
        rendered = await asyncio.get_running_loop().run_in_executor(
            self._require_executor(),
            self._render,
            _Chunk(ids=ids, word_ids=(), word_sizes=()),
            speed,
            np.random.default_rng(seed),
            ort.RunOptions(),
        )
        if rendered is None:
            raise RuntimeError("hibari: model run was terminated")
        return rendered.samples, rendered.durations

    # -- request -------------------------------------------------------------------------------------

    async def _synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        if request.voice not in self._info.voices:
            raise ValueError(
                f"hibari: unknown voice {request.voice!r}; available: {', '.join(self._info.voices)}"
            )
        low, high = SPEED_RANGE
        if not low <= request.speed <= high:
            raise ValueError(f"hibari: speed {request.speed} is outside the native range {low}..{high}")
        executor = self._require_executor()
        loop = asyncio.get_running_loop()
        self._count(started=1)
        pending: tuple[asyncio.Future[_Rendered | None], ort.RunOptions] | None = None
        with counted_outcome(lambda outcome: self._count(**{outcome: 1})):
            try:
                plan = await loop.run_in_executor(executor, self._plan, request.text)
                rng = np.random.default_rng(request.seed)

                def submit(index: int) -> tuple[asyncio.Future[_Rendered | None], ort.RunOptions]:
                    options = ort.RunOptions()
                    job = loop.run_in_executor(
                        executor, self._render, plan.chunks[index], request.speed, rng, options
                    )
                    return job, options

                if plan.chunks:
                    pending = submit(0)
                chunk_offsets: list[int] = []
                word_samples: list[tuple[tuple[int, int], ...]] = []
                next_word = 0
                offset = 0
                for index in range(len(plan.chunks)):
                    assert pending is not None
                    rendered = await pending[0]
                    pending = submit(index + 1) if index + 1 < len(plan.chunks) else None
                    if rendered is None:
                        raise RuntimeError("hibari: model run was terminated")
                    chunk_offsets.append(offset)
                    word_samples.append(rendered.word_samples)
                    spans = []
                    while next_word < len(plan.words) and plan.words[next_word].last[0] == index:
                        word = plan.words[next_word]
                        (first_chunk, first_pw), (last_chunk, last_pw) = word.first, word.last
                        start = chunk_offsets[first_chunk] + word_samples[first_chunk][first_pw][0]
                        end = chunk_offsets[last_chunk] + word_samples[last_chunk][last_pw][1]
                        spans.append(WordSpan(word.char_start, word.char_end, start, max(start, end)))
                        next_word += 1
                    offset += len(rendered.samples)
                    yield AudioPiece(rendered.samples, SAMPLE_RATE, tuple(spans))
            finally:
                if pending is not None:
                    pending[1].terminate = True

    # -- worker-thread jobs ----------------------------------------------------------------------------

    def _load(self) -> None:
        """Load hibari (G2P and its OOV net included) and build one duration-exposing session per worker."""
        from hibari import Hibari, dsp

        tts = cast(_Hibari, Hibari(voice=self._voice))
        model = onnx.load(tts.model_path)
        model.graph.output.append(
            onnx.helper.make_tensor_value_info(DURATION_TENSOR, onnx.TensorProto.INT64, None)
        )
        serialized = model.SerializeToString()
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self._idle_sessions = [
            ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
            for _ in range(self._workers)
        ]
        self._tts = tts
        self._synth = cast(_Synth, dsp.synth)
        self._word_phonemes.cache_clear()
        tts.g2p("Voicewire")  # builds the G2P and loads its out-of-vocabulary net

    def _warm_worker(self, barrier: threading.Barrier) -> None:
        """Bind this thread's session and run one sentence on it; the barrier makes every worker thread
        take one warm-up job, so all sessions are bound and warm."""
        plan = self._plan(_WARMUP_TEXT)
        rng = np.random.default_rng(0)
        for chunk in plan.chunks:
            self._render(chunk, 1.0, rng, ort.RunOptions())
        barrier.wait(timeout=120.0)

    def _session(self) -> ort.InferenceSession:
        session: ort.InferenceSession | None = getattr(self._thread_state, "session", None)
        if session is None:
            session = self._idle_sessions.pop()
            self._thread_state.session = session
        return session

    def _render(
        self, chunk: _Chunk, speed: float, rng: np.random.Generator, options: ort.RunOptions
    ) -> _Rendered | None:
        """Model then DSP for one chunk; None when `options.terminate` was set (the request is gone)."""
        session = self._session()
        synth = self._synth
        assert synth is not None
        self._count(runs_in_flight=1)
        try:
            began = time.perf_counter()
            feeds = {
                "ids": np.asarray([chunk.ids], np.int64),
                "speed": np.asarray([speed], np.float32),
            }
            try:
                outputs = cast(list[npt.NDArray[np.generic]], session.run(None, feeds, options))
            except Exception:
                if options.terminate:
                    return None
                raise
            if options.terminate:
                return None
            modelled = time.perf_counter()
            lh, theta, ln, lr, phi, f0 = (output[0] for output in outputs[:6])
            samples = _soft_limit(synth(lh, theta, ln, lr, phi, f0, rng), self._gain)
            durations = np.asarray(outputs[6], np.int64).reshape(-1)
            done = time.perf_counter()
        finally:
            self._count(runs_in_flight=-1)
        bounds = np.concatenate(([0], np.cumsum(durations) * DURATION_UNIT)).tolist()
        n = len(samples)
        word_samples = tuple((min(bounds[a], n), min(bounds[b + 1], n)) for a, b in chunk.word_ids)
        self._count(
            model_seconds=modelled - began, dsp_seconds=done - modelled, audio_seconds=n / SAMPLE_RATE
        )
        return _Rendered(samples, durations, word_samples)

    def _plan(self, sent: str) -> _Plan:
        """Sentences -> phoneme chunks (exactly as `Hibari.phonemize` of `phonemizer_text(sent)`), and each
        written word's phoneme words, aligned per sentence so a word never lands in another sentence's
        chunk; word char ranges index `sent`."""
        tts = self._require_tts()
        text, origin = phonemizer_text(sent)
        chunks: list[_Chunk] = []
        words: list[_PlannedWord] = []
        with self._g2p_lock:
            position = 0
            for sentence in tts.split_sentences(text):
                # split_sentences returns stripped substrings of `text`, in order
                start = text.find(sentence, position)
                position = start + len(sentence)
                phoneme_words: list[tuple[int, int]] = []
                lengths: list[int] = []
                for phonemes in tts.phonemize(sentence):
                    chunk = self._chunk(phonemes)
                    if chunk is None:
                        continue
                    phoneme_words += [(len(chunks), index) for index in range(len(chunk.word_ids))]
                    lengths += chunk.word_sizes
                    chunks.append(chunk)
                written = _text_words(text, start, position)
                owners = self._align([self._word_phonemes(raw) for _, _, raw in written], lengths)
                for (char_start, char_end, _), owned in zip(written, owners, strict=True):
                    if origin is not None:
                        char_start, char_end = origin[char_start], origin[char_end - 1] + 1
                    if owned:
                        words.append(
                            _PlannedWord(
                                char_start, char_end, phoneme_words[owned[0]], phoneme_words[owned[-1]]
                            )
                        )
        return _Plan(tuple(chunks), tuple(words))

    def _chunk(self, phonemes: str) -> _Chunk | None:
        """Ids exactly as `Hibari.ids`, plus the speech-symbol id range and size of each phoneme word;
        None when the string holds no speech."""
        vocab = self._require_tts().vocab
        ids = [0]
        words: list[list[int]] = [[]]
        for char in phonemes:
            if char == " ":
                words.append([])
            if char in vocab:
                if char != " " and char not in _PAUSE_SYMBOLS:
                    words[-1].append(len(ids))
                ids.append(vocab[char])
        ids.append(0)
        speech = [word for word in words if word]
        if not speech:
            return None
        return _Chunk(tuple(ids), tuple((w[0], w[-1]) for w in speech), tuple(len(w) for w in speech))

    def _g2p_word(self, word: str) -> tuple[int, ...]:
        """Speech-symbol counts of the phoneme words G2P makes of one written word on its own."""
        g2p = self._require_tts().g2p
        vocab = self._require_tts().vocab
        counts = (
            sum(c in vocab and c not in _PAUSE_SYMBOLS for c in m.group())
            for m in _PHONEME_WORD.finditer(g2p(word))
        )
        return tuple(count for count in counts if count)

    @staticmethod
    def _align(written: Sequence[tuple[int, ...]], lengths: Sequence[int]) -> list[range]:
        """Which phoneme words (indices into `lengths`, their speech-symbol counts) each written word owns.

        Exact when the phoneme words each written word makes on its own add up to the sentence's;
        otherwise each phoneme word goes to the written word whose share of the G2P length covers the
        phoneme word's middle (monotonic, every phoneme word owned once)."""
        counts = [len(w) for w in written]
        if sum(counts) == len(lengths):
            bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).tolist()
            return [range(bounds[i], bounds[i + 1]) for i in range(len(written))]
        estimated = np.cumsum([sum(w) for w in written], dtype=np.float64)
        total_estimated = float(estimated[-1]) if len(estimated) else 0.0
        if total_estimated == 0.0:
            return [range(0) for _ in written]
        actual = np.cumsum(lengths, dtype=np.float64)
        middles = (actual - np.asarray(lengths, np.float64) / 2) / actual[-1] * total_estimated
        ends = estimated.tolist()
        owner = [min(bisect.bisect_right(ends, m), len(written) - 1) for m in middles.tolist()]
        firsts = {o: owner.index(o) for o in set(owner)}
        return [
            range(firsts[i], firsts[i] + owner.count(i)) if i in firsts else range(0)
            for i in range(len(written))
        ]

    # -- helpers -------------------------------------------------------------------------------------

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            self._stats = self._stats.plus(**deltas)

    def _require_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            raise RuntimeError("hibari: engine is not started (call start() first)")
        return self._executor

    def _require_tts(self) -> _Hibari:
        if self._tts is None:
            raise RuntimeError("hibari: engine is not started (call start() first)")
        return self._tts
