"""Codec side of the talker engine: the chunk schedule, seam-free windows, and batched SNAC decoding.

`ChunkStreamer` (pure) decides, from the frames a talker has produced so far, which frames to decode and
which samples of the decoded window to send:

- **Ramped schedule.** The first chunk holds `initial_frames` frames; every later chunk holds as many
  frames as the listener already has (at least 1, at most `steady_frames`): 1, 1, 2, 4, 8, 16, 16, ...
  So a chunk's frames take no longer to generate than the audio already sent takes to play, whenever the
  talker runs at least about 1.3x real time: low time to first audio without a stall after it.
- **Seams.** SNAC's decoder is not causal: a sample depends on about 3 frames on each side. Every chunk is
  decoded with up to `left_context_frames` frames before it, so its first sample equals the whole-sequence
  decode. A chunk that starts at frame `lookahead_from_frame` or later also waits for `lookahead_frames`
  frames after it (by then the listener has audio buffered to cover the wait); an earlier chunk (the
  first, whose wait would add to time to first audio) holds back its last `holdback_samples`, where the
  missing future matters most, and the next chunk re-decodes and sends them. The final chunk is exact
  (there is no future). Chunk boundaries are a pure function of frame counts, never of timing.

`SnacCodec` loads a SNAC model from a local folder (`config.json` + `pytorch_model.bin`, the layout of
hubertsiuzdak/snac_24khz) and decodes batches of equal-length windows. `CodecBatcher` collects the windows
every session asks for and decodes those of equal length together, one batch at a time on one worker
thread, so concurrent sessions share device launches.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from voicewire.adapters.base import FloatAudio
from voicewire.adapters.talker_layout import CODES_PER_FRAME, SAMPLES_PER_FRAME, CodeFrames, to_snac_levels


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    """How frames are grouped into chunks and decoded (see the module doc)."""

    initial_frames: int = 1
    steady_frames: int = 16
    left_context_frames: int = 3
    lookahead_frames: int = 1
    lookahead_from_frame: int = 2
    holdback_samples: int = 512

    def __post_init__(self) -> None:
        if self.initial_frames < 1 or self.steady_frames < 1:
            raise ValueError("chunk sizes must be at least 1 frame")
        if self.left_context_frames < 0 or self.lookahead_frames < 0:
            raise ValueError("context frames must be >= 0")
        if not 0 <= self.holdback_samples < SAMPLES_PER_FRAME:
            raise ValueError(f"holdback_samples must be in [0, {SAMPLES_PER_FRAME})")
        if self.holdback_samples and not self.left_context_frames:
            raise ValueError("holdback_samples needs left_context_frames >= 1 (the next chunk re-decodes them)")


@dataclass(frozen=True, slots=True)
class DecodeWindow:
    """One chunk to decode: `frames` (shape (n, 7)) start at unit frame `first_frame`; of the decoded
    window audio, samples `[emit_start, emit_end)` are the chunk's output. `chunk_frames` counts the new
    frames the chunk covers (context excluded)."""

    first_frame: int
    frames: CodeFrames
    emit_start: int
    emit_end: int
    chunk_frames: int


@dataclass(slots=True)
class ChunkStreamer:
    """Chunk decisions for one unit (pure; see the module doc). Feed frames with `push`, end with
    `finish`; each returns the windows now due, in playback order. Memory: the unit's codes (7 int64 per
    frame; a unit is bounded by the talker's token cap)."""

    policy: ChunkPolicy
    initial_frames: int
    _frames: list[CodeFrames] = field(default_factory=list)
    _total: int = 0
    _next: int = 0
    _emitted: int = 0
    _chunks: int = 0
    _codes: CodeFrames | None = None

    def push(self, frames: CodeFrames) -> list[DecodeWindow]:
        if len(frames):
            self._frames.append(frames)
            self._total += len(frames)
            self._codes = None
        due: list[DecodeWindow] = []
        while True:
            size = self.initial_frames if self._chunks == 0 else min(max(self._next, 1), self.policy.steady_frames)
            lookahead = self.policy.lookahead_frames if self._next >= self.policy.lookahead_from_frame else 0
            if self._total < self._next + size + lookahead:
                return due
            held = self.policy.holdback_samples if lookahead < self.policy.lookahead_frames else 0
            due.append(self._window(self._next + size, lookahead, held))

    def finish(self) -> list[DecodeWindow]:
        """The rest of the unit, exactly (no holdback): whatever frames no chunk covered yet."""
        if self._emitted >= self._total * SAMPLES_PER_FRAME:
            return []
        return [self._window(self._total, 0, 0)]

    def _window(self, end: int, lookahead: int, held: int) -> DecodeWindow:
        start = self._next
        first = start - min(self.policy.left_context_frames, start)
        origin = first * SAMPLES_PER_FRAME
        emit_end = end * SAMPLES_PER_FRAME - held
        window = DecodeWindow(first, self._all()[first:end + lookahead], self._emitted - origin,
                              emit_end - origin, end - start)
        self._next = end
        self._emitted = emit_end
        self._chunks += 1
        return window

    def _all(self) -> CodeFrames:
        if self._codes is None:
            self._codes = np.concatenate(self._frames) if self._frames else np.zeros((0, CODES_PER_FRAME), np.int64)
            self._frames = [self._codes]
        return self._codes


class SnacCodec:
    """A SNAC decoder loaded from a local folder; `decode` turns a batch of equal-length frame windows
    into audio. Not thread-safe: one caller at a time (`CodecBatcher` guarantees it)."""

    def __init__(self, model_dir: str | Path, device: str = "auto") -> None:
        self.model_dir = Path(model_dir)
        self.device = device
        self._model: Any = None
        self._torch: Any = None

    def load(self) -> None:
        """Build the model from `config.json`, load `pytorch_model.bin`, fold weight norm, move it to the
        device. Reads only the folder (no hub access)."""
        import torch
        from snac import SNAC

        config_path = self.model_dir / "config.json"
        weights_path = self.model_dir / "pytorch_model.bin"
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"talker codec: {path} is missing (expected a SNAC folder)")
        config = json.loads(config_path.read_text())
        if config.get("sampling_rate", 24000) != 24000 or list(config.get("vq_strides", [])) != [4, 2, 1]:
            raise ValueError("talker codec: expected a 24 kHz SNAC with vq_strides [4, 2, 1] (Orpheus' codec)")
        model = SNAC(**config)
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        for module in model.modules():
            if torch.nn.utils.parametrize.is_parametrized(module, "weight"):
                torch.nn.utils.parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self._model = model.to(device).eval()
        self._torch = torch

    def decode(self, frames: CodeFrames) -> npt.NDArray[np.float32]:
        """Frames of shape (batch, n, 7) -> float32 audio of shape (batch, n * 2048)."""
        torch = self._torch
        if torch is None:
            raise RuntimeError("talker codec: not loaded (call load() first)")
        with torch.inference_mode():
            codes = [torch.from_numpy(np.ascontiguousarray(level)).to(self.device)
                     for level in to_snac_levels(frames)]
            audio = self._model.decode(codes)
            return cast(npt.NDArray[np.float32], audio[:, 0, :].float().cpu().numpy())


@dataclass(frozen=True, slots=True)
class CodecStats:
    """Codec work since start: decode calls (`batches`), windows decoded, the largest batch, frames."""

    batches: int = 0
    windows: int = 0
    max_batch: int = 0
    frames: int = 0


class CodecBatcher:
    """Decodes windows from any number of concurrent requests, batching those of equal length.

    `decode(window)` queues the window and waits for its audio. One worker task takes everything queued,
    groups it by window length and decodes each group as one batch (at most `max_batch` windows) on the
    codec thread; windows queued meanwhile form the next batches. Cancelling a waiter is safe at any time
    (its result is dropped). (Tried on the H200: serving the most urgent window's group first with a
    256-frame cap per batch doubled the batches and raised TTFA at 64 sessions from 93 to 132 ms.)
    Memory: the queued windows' codes and one batch of audio.
    """

    def __init__(self, codec: SnacCodec, max_batch: int = 64) -> None:
        self.codec = codec
        self.max_batch = max_batch
        self.stats = CodecStats()
        self._queue: list[tuple[DecodeWindow, asyncio.Future[FloatAudio]]] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker on the running loop (the codec must be loaded)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="talker-codec")
        self._wake = asyncio.Event()
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="talker-codec")

    async def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        for _, future in self._queue:
            future.cancel()
        self._queue.clear()
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True)

    async def decode(self, window: DecodeWindow) -> FloatAudio:
        """The window's output samples (`emit_start:emit_end` of its decoded audio)."""
        if self._wake is None:
            raise RuntimeError("talker codec: batcher not started")
        future: asyncio.Future[FloatAudio] = asyncio.get_running_loop().create_future()
        self._queue.append((window, future))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                taken, self._queue = self._queue, []
                groups: dict[int, list[tuple[DecodeWindow, asyncio.Future[FloatAudio]]]] = {}
                for job in taken:
                    if not job[1].done():
                        groups.setdefault(len(job[0].frames), []).append(job)
                for jobs in groups.values():
                    for at in range(0, len(jobs), self.max_batch):
                        await self._decode_batch(loop, jobs[at:at + self.max_batch])

    async def _decode_batch(self, loop: asyncio.AbstractEventLoop,
                            batch: list[tuple[DecodeWindow, asyncio.Future[FloatAudio]]]) -> None:
        codes = np.stack([window.frames for window, _ in batch])
        try:
            audio = await loop.run_in_executor(self._executor, self.codec.decode, codes)
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        self._count(len(batch), codes.shape[0] * codes.shape[1])
        for row, (window, future) in enumerate(batch):
            if not future.done():
                future.set_result(np.ascontiguousarray(audio[row, window.emit_start:window.emit_end]))

    def _count(self, size: int, frames: int) -> None:
        s = self.stats
        self.stats = CodecStats(s.batches + 1, s.windows + size, max(s.max_batch, size), s.frames + frames)
