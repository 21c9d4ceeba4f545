"""Codec side of the talker engine: the chunk schedule, seam-free windows, and batched SNAC decoding.

`ChunkStreamer` (pure) decides, from the frames a talker has produced so far, which frames to decode and
which samples of the decoded window to send:

- **Ramped schedule.** The first chunk holds `initial_frames` frames; every later chunk holds `growth`
  times the frames already sent (rounded down; at least 1, at most `steady_frames`): with the default 0.5,
  1, 1, 1, 1, 2, 3, 4, 6, 9, 14, 16, 16, ... A chunk's frames must be generated while the audio already
  sent plays: the next chunk needs `growth` x N frames while the listener holds N frames less what played
  during the ramp, so the ramp is stall-free while the talker runs at a real-time factor up to about
  1 / (1 + growth): 0.66 for 0.5 (doubling, growth 1.0, allows only 0.5). Past the ramp, any real-time
  factor under 1 keeps the buffer growing. Low time to first audio without a stall after it, with room
  for a talker slowed by a large batch.
- **Paced by the listener's clock.** With `now` passed to `push`, the streamer keeps the listener's clock
  (playback taken to start when the first chunk is cut, so the clock errs early) and the talker's measured
  pace (seconds per frame and between arrivals, smoothed over the unit). Two rules bend the ramp to them:
  a chunk grows beyond the ramp (up to `steady_frames`) as far as the talker can still produce its frames
  before the audio already cut has played, less `margin_s` (a fast talker: fewer, larger codec windows,
  which leaves the device to the talker); and whenever the audio cut so far would run out within
  `margin_s` plus the time to the next arrival of frames, the frames in hand go out at once as a chunk (a
  slow talker under load: a chunk is never later than the audio before it, for any real-time factor
  under 1, where the ramp alone runs dry past about 0.66). The margin follows the engine's load: the
  caller reports each chunk's cut -> decoded latency (`delivered`), and the margin is at least its recent
  peak plus `delivery_slack_s` (a codec busy with large batches needs chunks cut earlier), and at least the
  codec's backlog at the moment of the push (`backlog_s`: the work queued ahead of a window cut now) plus
  the same slack, so a queue that deepens at once (many sessions cutting together) is met when it forms,
  not one chunk later. Until the pace
  is known (one arrival), frames in hand after the first chunk go out at once. A talker slower than real
  time, both lately (the smoothed pace) and over the unit so far, gets no early cuts: the listener hears a
  gap either way, and the ramp's larger chunks keep the codec from adding to the load that slowed it. A
  talker slow for a few steps only (a burst's prefill, a long step) still gets them: its listener has audio
  in hand that early cuts protect, where waiting for a ramp-sized chunk at the slow pace would run it dry.
  Without `now` the schedule is the ramp alone.
- **Seams.** SNAC's decoder is not causal: a sample depends on about 3 frames on each side. Every chunk is
  decoded with up to `left_context_frames` frames before it, so its first sample equals the whole-sequence
  decode. A chunk that starts at frame `lookahead_from_frame` or later also waits for `lookahead_frames`
  frames after it (by then the listener has audio buffered to cover the wait); an earlier chunk (the
  first, whose wait would add to time to first audio) is decoded with `pad_frames` copies of its last
  frame standing in for the future it does not wait for. Speech is locally stationary, so the stand-in
  keeps the step at the seam well below a typical sample-to-sample step, where decoding with no future at
  all leaves a click. So every chunk carries exactly its frames (2048 samples each), the first chunk
  exactly `initial_frames`. The final chunk is exact (there is no future), and so is an early chunk that
  ends the unit when the frames that end it arrive marked `final`; one cut before the unit's end was known
  (a unit of 1-2 frames, or of exactly a per-session first chunk) ends on the stand-in. Chunk boundaries
  are a function of frame counts and, when paced, of the times `push` was given.

`SnacCodec` loads a SNAC model from a local folder (`config.json` + `pytorch_model.bin`, the layout of
hubertsiuzdak/snac_24khz) and decodes batches of equal-length windows; on a GPU in float16 through CUDA
graphs captured per window length and batch bucket. `CodecBatcher` collects the windows every session asks
for and decodes those of equal length together, one batch at a time on one worker thread, most urgent
length first (earliest deadline), so concurrent sessions share device launches and a first chunk never
waits behind windows that have seconds of audio in hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import math
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
import numpy.typing as npt
from voicewire.adapters.talker_layout import CODES_PER_FRAME, SAMPLE_RATE, SAMPLES_PER_FRAME, CodeFrames
from voicewire.protocol.engine import FloatAudio

T = TypeVar("T")
log = logging.getLogger("voicewire.talker")


@dataclass(frozen=True, slots=True)
class FrameLayout:
    """A codec's frame: `codes_per_frame` int64 codes in, `samples_per_frame` samples out at `sample_rate`."""

    codes_per_frame: int
    samples_per_frame: int
    sample_rate: int

    @property
    def frame_s(self) -> float:
        """Seconds of audio in one frame."""
        return self.samples_per_frame / self.sample_rate


SNAC_LAYOUT = FrameLayout(CODES_PER_FRAME, SAMPLES_PER_FRAME, SAMPLE_RATE)
"""Orpheus' SNAC 24 kHz frames (`talker_layout`): 7 codes, 2048 samples (85.3 ms)."""


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    """How frames are grouped into chunks and decoded (see the module doc)."""

    initial_frames: int = 1
    steady_frames: int = 16
    growth: float = 0.5
    left_context_frames: int = 3
    lookahead_frames: int = 1
    lookahead_from_frame: int = 2
    pad_frames: int = 1
    margin_s: float = 0.12
    """Paced streams: how long before the listener runs dry a chunk must be cut (codec queue and decode, the
    hand-back and the socket); the measured time between two arrivals of frames is added."""
    pace_smoothing: float = 0.25
    """Weight of the newest inter-arrival time in the talker's measured seconds per frame."""
    delivery_slack_s: float = 0.08
    """Paced streams with measured delivery (`ChunkStreamer.delivered`): the margin is at least the recent
    peak of cut -> decoded latency plus this (the hand-back and the socket), and at least the codec's backlog
    given with a push (`ChunkStreamer.push`) plus this (the window's own decode, the hand-back, the socket).
    80 ms: on the H200 at 128 sessions a codec batch took 21-24 ms at the median but up to 40 ms, which left
    10 ms of a 50 ms slack for the rest, and 1-10 streams stalled 4-12 ms in 2 rounds of 5 (docs/benchmarks.md)."""
    delivery_hold: float = 0.9
    """Per delivered chunk, the factor by which the held peak delivery latency decays toward newer ones."""
    held_first_frames: int = 2
    """`ChunkStreamer.push`'s `hold_first`: while it holds, the first chunk waits until it has this many frames
    (at least `initial_frames` + 1), then takes every frame in hand."""

    def __post_init__(self) -> None:
        if self.initial_frames < 1 or self.steady_frames < 1:
            raise ValueError("chunk sizes must be at least 1 frame")
        if not 0 < self.growth <= 1:
            raise ValueError("growth must be in (0, 1]")
        if min(self.left_context_frames, self.lookahead_frames, self.pad_frames) < 0:
            raise ValueError("context and pad frames must be >= 0")
        if self.margin_s < 0 or not 0 < self.pace_smoothing <= 1:
            raise ValueError("margin_s must be >= 0 and pace_smoothing in (0, 1]")
        if self.delivery_slack_s < 0 or not 0 <= self.delivery_hold < 1:
            raise ValueError("delivery_slack_s must be >= 0 and delivery_hold in [0, 1)")
        if self.held_first_frames < 1:
            raise ValueError("held_first_frames must be at least 1")

    def next_size(self, sent: int) -> int:
        """Frames in the chunk after the first `sent` frames (the ramp; see the module doc)."""
        return min(max(math.floor(sent * self.growth), 1), self.steady_frames)


@dataclass(frozen=True, slots=True)
class DecodeWindow:
    """One chunk to decode: `frames` (shape (n, codes per frame)) start at unit frame `first_frame` (negative:
    in the left context given by `ChunkStreamer.context`; the last rows may be copies of the last real frame,
    standing in for a future not waited for); of the decoded window audio,
    samples `[emit_start, emit_end)` are the chunk's output. `chunk_frames` counts the new frames the chunk
    covers (context excluded)."""

    first_frame: int
    frames: CodeFrames
    emit_start: int
    emit_end: int
    chunk_frames: int


@dataclass(slots=True)
class FirstChunkSizer:
    """Engine-wide: the frames a unit's first chunk needs to play until its second can follow, from what every
    stream measured lately. A second chunk comes one talker step after the first (the stream's next frame)
    plus its own cut -> decoded latency, where the first chunk's audio plays from its own delivery; its
    latency may be longer than the first's (a first chunk is the codec's most urgent window), so the first
    chunk is sized to cover the step and the whole latency: ceil((step + latency) / frame), between the
    caller's floor and `cap`. Under light load that is one frame (a step and a decode well inside 80 ms); under
    a burst's slow first steps, two or more, one step later. Both figures are smoothed over every stream's
    observations (`weight` each, so a burst's first steps move them within a fraction of one step's arrivals)
    and 0 until observed: an idle engine's first chunk is the floor."""

    frame_s: float
    """Seconds of audio in one frame."""
    cap: int
    """The most frames a first chunk is sized to (a talker slower than real time runs dry whatever it is)."""
    weight: float = 0.1
    step_s: float = 0.0
    """Smoothed seconds between two arrivals of one stream's frames, per frame."""
    delivery_s: float = 0.0
    """Smoothed cut -> decoded latency of every stream's chunks."""

    def arrived(self, gap_s: float, frames: int) -> None:
        """One stream's `frames` arrived `gap_s` after its previous ones."""
        if frames > 0:
            self.step_s += self.weight * (max(gap_s, 0.0) / frames - self.step_s)

    def delivered(self, latency_s: float) -> None:
        """A chunk's audio was decoded `latency_s` after its frames were cut."""
        self.delivery_s += self.weight * (max(latency_s, 0.0) - self.delivery_s)

    def first_chunk_frames(self, floor: int) -> int:
        """The first chunk's frames for a unit starting now: at least `floor`, at most `cap` (or `floor`)."""
        need = math.ceil((self.step_s + self.delivery_s) / self.frame_s - 1e-9)
        return min(max(floor, need), max(floor, self.cap))


@dataclass(slots=True)
class ChunkStreamer:
    """Chunk decisions for one unit (pure; see the module doc). Feed frames with `push`, end with
    `finish`; each returns the windows now due, in playback order. Memory: the unit's codes (7 int64 per
    frame; a unit is bounded by the talker's token cap)."""

    policy: ChunkPolicy
    initial_frames: int
    layout: FrameLayout = SNAC_LAYOUT
    """The codec's frame: codes per frame and the audio each frame decodes to."""
    window_lengths: tuple[int, ...] = ()
    """Preferred window lengths (the codec's CUDA graph shapes, ascending): a window shorter than one of them
    takes more left context, when the unit has the frames, to reach the next one (more context changes no
    sample it sends by more than the seam tolerance, and it is exact where the context reaches 3 frames)."""
    _frames: list[CodeFrames] = field(default_factory=list)
    _total: int = 0
    _next: int = 0
    _base: int = 0
    """Frames of left context given before the unit's own (`context`): unit frame i is `_base + i` here."""
    _codes: CodeFrames | None = None
    _played_from: float | None = None
    """Paced: when the first chunk was cut (the listener's clock starts there)."""
    _last_arrival: float | None = None
    _first_arrival: float | None = None
    """Paced: when the unit's first frames arrived."""
    _frames_since_first: int = 0
    """Paced: frames that arrived after the first arrival (the unit's mean pace is the time since over these)."""
    _frame_s: float | None = None
    """Paced: the talker's measured seconds per frame (smoothed)."""
    _gap_s: float | None = None
    """Paced: the measured seconds between two arrivals of frames (smoothed): how long the next chance to cut
    may be away."""
    _delivery_s: float = 0.0
    """Paced: the held peak of the cut -> decoded latency reported by `delivered` (0 until one is)."""
    _backlog_s: float = 0.0
    """Paced: the codec's backlog given with the latest push."""
    _held: bool = False
    """A push held the first chunk back (`push`'s `hold_first`): it takes every frame in hand when cut."""

    @property
    def _held_frames(self) -> int:
        """The frames a held first chunk waits for (`ChunkPolicy.held_first_frames`, `push`)."""
        return max(self.policy.held_first_frames, self.initial_frames + 1)

    def context(self, frames: CodeFrames) -> None:
        """Frames that precede the unit's own as the decoder's left context only (a cloned voice's reference
        codes): windows take them as context, no chunk covers them. Only before the first `push`; raises
        RuntimeError after it."""
        if self._total:
            raise RuntimeError("codec: left context only before the unit's first frames")
        if len(frames):
            self._frames.append(frames)
            self._total = self._next = self._base = len(frames)
            self._codes = None

    def push(self, frames: CodeFrames, final: bool = False, now: float | None = None,
             backlog_s: float = 0.0, hold_first: bool = False) -> list[DecodeWindow]:
        """Add `frames`; `final` says no frame follows them (a chunk ending the unit then needs no stand-in
        future); `now` (seconds, any monotonic clock, the same for every call) paces the schedule by the
        listener's clock and the talker's speed (module doc); `backlog_s`, the codec's estimated work queued
        ahead of a window cut now (`CodecBatcher.backlog_s`), widens the margin for this push. `hold_first`
        says the talker's next frame may be far off (e.g. other units' prompts wait for its prefill): a
        first chunk not yet cut then waits, while pushes say so, until it holds `held_first_frames` frames
        and more than `initial_frames` (unless the frames are `final`), and when cut takes every frame in
        hand (at most `steady_frames`), so that its audio covers the wait instead of running dry in it. Call
        `finish()` after the last push either way."""
        self._backlog_s = max(backlog_s, 0.0)
        if len(frames):
            self._frames.append(frames)
            self._total += len(frames)
            self._codes = None
            if now is not None:
                self._measure_pace(len(frames), now)
        due: list[DecodeWindow] = []
        while self._next < self._total:
            first = self._next == self._base
            if first and hold_first and not final and self._total - self._base < self._held_frames:
                self._held = True
                break
            if first and self._held:
                size = min(max(self._total - self._next, self.initial_frames), self.policy.steady_frames)
            elif first:
                size = self.initial_frames
            else:
                size = max(self.policy.next_size(self._next - self._base), self._affordable(now))
            lookahead = self._lookahead()
            if self._total >= self._next + size + lookahead:
                end = self._next + size
            elif not first and self._running_dry(now):
                end, lookahead = self._total, 0  # what is there, now: the audio before it is about to run out
            else:
                break
            ends_unit = final and end == self._total
            pad = self.policy.pad_frames if lookahead < self.policy.lookahead_frames and not ends_unit else 0
            due.append(self._window(end, lookahead, pad))
            if first and now is not None:
                self._played_from = now
        return due

    def finish(self) -> list[DecodeWindow]:
        """The rest of the unit, exactly (nothing stands in for a future): the frames no chunk covered yet."""
        if self._next >= self._total:
            return []
        return [self._window(self._total, 0, 0)]

    def delivered(self, latency_s: float) -> None:
        """Report how long the last chunk took from its cut to its decoded audio (codec queue and decode):
        under load this grows, and so does the margin the paced rules keep (`ChunkPolicy.delivery_slack_s`)."""
        self._delivery_s = max(latency_s, self._delivery_s * self.policy.delivery_hold)

    def _margin(self) -> float:
        slack = self.policy.delivery_slack_s
        return max(self.policy.margin_s, self._delivery_s + slack if self._delivery_s else 0.0,
                   self._backlog_s + slack if self._backlog_s else 0.0)

    def _measure_pace(self, frames: int, now: float) -> None:
        if self._last_arrival is not None:
            gap = max(0.0, now - self._last_arrival)
            self._frame_s = self._smooth(self._frame_s, gap / frames)
            self._gap_s = self._smooth(self._gap_s, gap)
            self._frames_since_first += frames
        else:
            self._first_arrival = now
        self._last_arrival = now

    def _smooth(self, average: float | None, sample: float) -> float:
        weight = self.policy.pace_smoothing
        return sample if average is None else (1 - weight) * average + weight * sample

    def _buffer_left(self, now: float | None) -> float | None:
        """Paced: seconds of audio cut so far that the listener has not played yet at `now` (None unpaced)."""
        if now is None or self._played_from is None:
            return None
        return self._played_from + (self._next - self._base) * self.layout.frame_s - now

    def _running_dry(self, now: float | None) -> bool:
        left = self._buffer_left(now)
        if left is None:
            return False
        if self._gap_s is None:
            return True  # until a second arrival shows the talker's pace, any wait may be too long
        if self._frame_s is not None and self._frame_s >= self.layout.frame_s and self._slow_over_unit():
            return False  # slower than real time: a gap comes anyway; chunks of the ramp's size cost less codec work
        return left <= self._margin() + self._gap_s

    def _slow_over_unit(self) -> bool:
        """Paced: the talker's mean seconds per frame since the unit's first arrival is at least a frame's audio."""
        if self._first_arrival is None or self._last_arrival is None or not self._frames_since_first:
            return False
        return (self._last_arrival - self._first_arrival) / self._frames_since_first >= self.layout.frame_s

    def _affordable(self, now: float | None) -> int:
        """Paced: the largest next chunk whose missing frames the talker makes, at its measured pace, before
        the audio cut so far has played less the margin (0 when unpaced or unknown)."""
        left = self._buffer_left(now)
        if left is None or not self._frame_s:
            return 0
        lookahead = self._lookahead()
        makeable = int((left - self._margin()) / self._frame_s)
        in_hand = self._total - self._next - lookahead
        return min(max(in_hand + makeable, 0), self.policy.steady_frames)

    def _lookahead(self) -> int:
        """The frames the next chunk waits for after it (`ChunkPolicy.lookahead_from_frame`)."""
        return self.policy.lookahead_frames if self._next - self._base >= self.policy.lookahead_from_frame else 0

    def _window(self, end: int, lookahead: int, pad: int) -> DecodeWindow:
        start = self._next
        first = start - min(self.policy.left_context_frames, start)
        stop = end + lookahead
        target = next((n for n in self.window_lengths if n >= stop + pad - first), None)
        if target is not None and stop + pad - target >= 0:
            first = min(first, stop + pad - target)
        frames = self._all()[first:stop]
        if pad:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        spf = self.layout.samples_per_frame
        window = DecodeWindow(first - self._base, frames, (start - first) * spf, (end - first) * spf, end - start)
        self._next = end
        return window

    def _all(self) -> CodeFrames:
        if self._codes is None:
            self._codes = (np.concatenate(self._frames) if self._frames
                           else np.zeros((0, self.layout.codes_per_frame), np.int64))
            self._frames = [self._codes]
        return self._codes


def padded(frames: CodeFrames, length: int) -> CodeFrames:
    """`frames` (n, codes per frame) with copies of the last frame appended up to `length` rows (as they are
    when n is `length` or more)."""
    missing = length - len(frames)
    return frames if missing <= 0 else np.concatenate([frames, np.repeat(frames[-1:], missing, axis=0)])


def graph_plan(lengths: Sequence[int], max_batch: int, batches: Sequence[int],
               max_frames: int | None = None, span: Callable[[int], int] = int) -> list[tuple[int, int]]:
    """Every (batch bucket, window length) shape to capture for windows of `lengths` frames in batches of up
    to `max_batch` windows and `max_frames` frames of audio decoded (None: no frame cap; a window of n frames
    decodes `span(n)`, all n by default): the buckets of `batches` below `max_batch`, and `max_batch`
    itself, of those a batch of the length can fill (at least the smallest, as `batch_size` makes no batch
    of more); the most work (batch x span) first."""
    buckets = [b for b in batches if b < max_batch] + [max_batch]
    shapes = {(b, n) for n in set(lengths) for i, b in enumerate(buckets)
              if i == 0 or max_frames is None or b * span(n) <= max_frames}
    return sorted(shapes, key=lambda s: (s[0] * span(s[1]), s), reverse=True)


def batch_size(length: int, max_batch: int, max_batch_frames: int, captured: Sequence[int]) -> int:
    """Windows that each decode `length` frames of audio (`GraphedCodec.span`) per codec batch: at most
    `max_batch` and `max_batch_frames` frames (at least one window), rounded down to a batch the codec has a
    CUDA graph for at the window's length (`captured`, ascending), so no padded rows are decoded and no batch
    meets an unseen shape eagerly (cuDNN builds its plans then: up to a second mid-stream on the GPU) when a
    smaller captured one can take it. With no graph for the length (on the CPU, or none captured), rounded
    down to a `GraphedCodec.GRAPH_BATCHES` bucket or `max_batch`."""
    fits = min(max_batch, max(1, max_batch_frames // max(length, 1)))
    if captured:
        return max((b for b in captured if b <= fits), default=fits)
    return max((b for b in (*GraphedCodec.GRAPH_BATCHES, max_batch) if b <= fits), default=1)


def capture_shapes(shapes: Sequence[tuple[int, int]], capture: Callable[[int, int], T],
                   out_of_memory: type[BaseException]) -> dict[tuple[int, int], T]:
    """`capture(batch, frames)` for each shape in order, into {shape: graph}. A shape that raises
    `out_of_memory` is left out and the rest are still tried (smaller shapes may fit); any other error ends
    the capture, keeping the graphs already made (a decoder that cannot be captured decodes eagerly). Logs
    what was left out."""
    graphs: dict[tuple[int, int], T] = {}
    skipped: list[tuple[int, int]] = []
    for shape in shapes:
        try:
            graphs[shape] = capture(*shape)
        except out_of_memory:
            skipped.append(shape)
        except Exception:
            log.exception("talker codec: CUDA graph capture failed at (batch, frames) %s; %d of %d shapes "
                          "captured, the rest decode eagerly", shape, len(graphs), len(shapes))
            return graphs
    if skipped:
        log.warning("talker codec: out of GPU memory for %d of %d CUDA graphs (largest (batch, frames) %s); "
                    "their batches decode in a larger captured bucket or eagerly. Give the talker a smaller "
                    "gpu_memory_utilization or a smaller codec_max_batch.", len(skipped), len(shapes), skipped[0])
    return graphs


class GraphedCodec:
    """A decoder that turns a batch of equal-length frame windows into audio, on a GPU through CUDA graphs
    captured per window length and batch bucket. Subclasses load the model (`load`: set `_model`,
    `_torch`, `device`, `dtype`, `_stream` on CUDA, and `_model32` where a reduced-precision batch whose audio
    is not finite should be decoded again in float32) and map codes to audio (`_forward`). Not thread-safe:
    one caller at a time (`CodecBatcher` guarantees it).

    `prepare()` captures one CUDA graph per window length and batch bucket (`GRAPH_BATCHES`), so a decode is
    three launches (codes in, graph, audio out) and one stream sync instead of hundreds of kernels and Python
    dispatches that each take and give back the GIL. A batch is padded with code-0 rows up to its bucket;
    shapes without a graph (longer windows, or on the CPU) run eagerly. `fallbacks` counts batches decoded
    again in float32.

    A `causal` decoder (no sample depends on a later frame) decodes a window padded at its end with copies of
    its last frame to any longer length, its samples unchanged: `CodecBatcher` pads each window to the next
    length given to `prepare()` (`padded_length`), so windows of nearby lengths share one call and every one
    meets a captured graph.

    A decoder whose late layers (the upsampling convolutions, where nearly all the work is) need only a few
    frames of left context sets `tail_frames` (and `tail_context`, those frames): given each row's chunk end
    (`decode(frames, ends)`), a window longer than `tail_frames` runs its early layers over every frame but
    its late ones over the last `tail_frames` frames up to the chunk's end only (`span`, `span_start`), and
    decodes that span's audio: the chunk's samples are the same while the window's left context costs the
    late layers nothing."""

    GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64)
    layout: FrameLayout = SNAC_LAYOUT
    causal: bool = False

    def __init__(self, device: str = "auto", dtype: str = "auto", cuda_graphs: bool = True) -> None:
        self.device = device
        self.dtype = dtype
        self.cuda_graphs = cuda_graphs
        self.fallbacks = 0
        self.tail_frames: int | None = None
        """Frames of audio a window decodes when its chunk end is given (None: every frame; see the class doc)."""
        self.tail_context = 0
        """Frames of left context the late layers need before a chunk's first frame (with `tail_frames`)."""
        self._model: Any = None
        self._model32: Any = None
        self._torch: Any = None
        self._stream: Any = None
        self._graphs: dict[tuple[int, int], Any] = {}
        self._graph_batches: dict[int, list[int]] = {}
        self._pool: Any = None
        self._captured = 0
        """Graphs captured into `_pool` so far (`prepare`)."""
        self._lengths: tuple[int, ...] = ()
        """The window lengths given to `prepare()`, ascending (on every device)."""
        self._buffers: Any = None

    def load(self) -> None:
        """Build the model and move it to the device (subclasses)."""
        raise NotImplementedError

    def _forward(self, codes: Any, starts: Any = None, model: Any = None) -> Any:
        """Codes (batch, n, codes per frame) int64 on the device -> float32 audio (batch, n * samples per frame);
        with `starts` (batch,) int64 on the device (`tail_frames` set), each row's audio of frames
        `[start, start + tail_frames)` only. No host sync (subclasses; `model` defaults to `_model`)."""
        raise NotImplementedError

    def span(self, length: int) -> int:
        """Frames of audio a window of `length` frames decodes when its chunk end is given: `tail_frames`
        where the window is longer, else all of it."""
        tail = self.tail_frames
        return length if tail is None or length <= tail else tail

    def span_start(self, length: int, end: int) -> int:
        """The first frame of the decoded span (`span`) of a window of `length` frames whose chunk ends at frame
        `end`: the span ends at the chunk's end, or starts at the window's start."""
        return min(max(end - self.span(length), 0), length - self.span(length))

    def _resolve(self, torch: Any) -> tuple[str, str]:
        """`device` and `dtype` with "auto" resolved: CUDA when there is one; float16 on CUDA, float32 elsewhere."""
        device = "cuda" if self.device == "auto" and torch.cuda.is_available() else self.device
        device = "cpu" if device == "auto" else device
        dtype = ("float16" if device.startswith("cuda") else "float32") if self.dtype == "auto" else self.dtype
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"codec: dtype {dtype!r} is not float32, float16 or bfloat16")
        return device, dtype

    @property
    def graph_shapes(self) -> int:
        """How many (batch bucket, window length) CUDA graphs `prepare()` captured."""
        return len(self._graphs)

    def graph_buckets(self, length: int) -> tuple[int, ...]:
        """The batch sizes with a captured graph for windows of `length` frames, ascending (none on the CPU)."""
        return tuple(self._graph_batches.get(length, ()))

    @property
    def graph_lengths(self) -> tuple[int, ...]:
        """The window lengths (frames) with captured graphs, ascending."""
        return tuple(sorted(self._graph_batches))

    def padded_length(self, frames: int) -> int:
        """The length a window of `frames` frames is decoded at: for a `causal` decoder the next length given
        to `prepare()` (the window padded at its end), else (or past the longest) `frames` itself."""
        if not self.causal:
            return frames
        return next((n for n in self._lengths if n >= frames), frames)

    def prepare(self, lengths: Sequence[int], max_batch: int, max_batch_frames: int | None = None) -> None:
        """On CUDA with `cuda_graphs`: capture a graph for each window length in `lengths` and every batch
        bucket up to `max_batch` windows and `max_batch_frames` frames (`graph_plan`: the shapes
        `CodecBatcher` with the same limits decodes; None: no frame cap). Measured on the H200 with SNAC: about
        1.2 s per (length, bucket) shape, mostly cuDNN building its plans for a shape it has not seen (an eager
        decode pays that too, the first time it meets a shape), so capture only the lengths the schedule
        produces. Elsewhere: nothing.

        The largest shapes are captured first (`graph_plan`), so that each later capture can take its memory
        from blocks the larger ones freed in the shared pool (a first shape that fails gives the rest a new
        pool: PyTorch's allocator refuses a pool whose only graph failed). Captured length by length, smallest batch
        first, the SNAC shapes for 128 sessions held 21 GB of graph pool and 24 GB of cached blocks on an 80 GB
        H100 beside vLLM when they ran out of memory. A shape that runs out of memory is skipped and the
        smaller ones are still tried (`capture_shapes`): its batches decode in a larger captured bucket if
        there is one, else eagerly."""
        torch = self._torch
        if torch is None:
            raise RuntimeError("codec: not loaded (call load() first)")
        self._lengths = tuple(sorted(set(lengths)))
        if not (self.cuda_graphs and self.device.startswith("cuda")) or not lengths:
            return
        shapes = graph_plan(lengths, max_batch, self.GRAPH_BATCHES, max_batch_frames, self.span)
        batch_rows = max(b for b, _ in shapes)
        max_frames = max(lengths)
        codes_per_frame, samples_per_frame = self.layout.codes_per_frame, self.layout.samples_per_frame
        with torch.inference_mode():
            codes_in = torch.zeros(batch_rows * max_frames * codes_per_frame, dtype=torch.int64, device=self.device)
            audio_out = torch.zeros(batch_rows * max_frames * samples_per_frame, dtype=torch.float32,
                                    device=self.device)
            finite = torch.ones(1, dtype=torch.bool, device=self.device)
            starts_in = torch.zeros(batch_rows, dtype=torch.int64, device=self.device)
            pinned = (torch.zeros(codes_in.numel(), dtype=torch.int64, pin_memory=True),
                      torch.zeros(audio_out.numel(), dtype=torch.float32, pin_memory=True),
                      torch.zeros(1, dtype=torch.bool, pin_memory=True),
                      torch.zeros(batch_rows, dtype=torch.int64, pin_memory=True))
            self._buffers = (codes_in, audio_out, finite, starts_in, pinned)
            self._pool, self._captured = torch.cuda.graph_pool_handle(), 0
            side = torch.cuda.Stream(device=self.device)
            self._graphs = capture_shapes(shapes, lambda batch, frames: self._capture(side, batch, frames),
                                          torch.OutOfMemoryError)
            self._graph_batches = {}
            for batch, frames in sorted(self._graphs):
                self._graph_batches.setdefault(frames, []).append(batch)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the warm-ups' eager blocks; the graphs' pool stays

    def _capture(self, side: Any, batch: int, frames: int) -> Any:
        """One graph for `batch` windows of `frames` frames, decoding each window's span (`span`) from the
        starts buffer where that is shorter than the window."""
        torch = self._torch
        codes_in, audio_out, finite, starts_in, _ = self._buffers
        codes_per_frame = self.layout.codes_per_frame
        codes = codes_in[:batch * frames * codes_per_frame].view(batch, frames, codes_per_frame)
        out = audio_out[:batch * self.span(frames) * self.layout.samples_per_frame].view(batch, -1)
        starts = starts_in[:batch] if self.span(frames) < frames else None
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(codes, starts)  # warm-up: cuDNN plans, allocator
        torch.cuda.current_stream().wait_stream(side)
        # capture_begin/end rather than `torch.cuda.graph`, which runs gc and empties the
        # allocator's cache before every one of the ~240 captures.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                audio = self._forward(codes, starts)
                out.copy_(audio)
                finite.copy_(torch.isfinite(audio).all().reshape(1))
            except BaseException:
                # end the capture, but let the first error through: an out-of-memory error must stay one
                # (`capture_shapes` skips only that shape), whatever ending a broken capture raises
                with contextlib.suppress(Exception):
                    graph.capture_end()
                if not self._captured:
                    # the failed graph held the pool's only use: PyTorch's allocator then refuses the handle
                    # for the next capture ("use_count > 0" internal assert), so later shapes take a new pool
                    self._pool = torch.cuda.graph_pool_handle()
                raise
            graph.capture_end()
        self._captured += 1
        return graph

    def decode(self, frames: CodeFrames, ends: Sequence[int] | None = None) -> npt.NDArray[np.float32]:
        """Frames of shape (batch, n, codes per frame) -> float32 audio of shape (batch, n * samples per frame)
        (a fresh array). With `ends` (each row's chunk end, in frames): (batch, span(n) * samples per frame),
        row i the audio of frames `span_start(n, ends[i])` on (`span`); the same as without where the span is
        the whole window."""
        torch = self._torch
        if torch is None:
            raise RuntimeError("codec: not loaded (call load() first)")
        batch, length = frames.shape[0], frames.shape[1]
        starts = None
        if ends is not None and self.span(length) < length:
            starts = np.array([self.span_start(length, end) for end in ends], np.int64)
        buckets = self._graph_batches.get(length) if starts is not None or self.span(length) == length else None
        bucket = next((b for b in buckets if b >= batch), None) if buckets else None
        with torch.inference_mode():
            if bucket is not None:
                audio, finite = self._replay(frames, starts, bucket)
            else:
                audio, finite = self._eager(frames, starts, self._model)
            if not finite and self._model32 is not None:
                self.fallbacks += 1
                audio, _ = self._eager(frames, starts, self._model32)
            return audio

    def _replay(self, frames: CodeFrames, starts: npt.NDArray[np.int64] | None,
                bucket: int) -> tuple[npt.NDArray[np.float32], bool]:
        torch = self._torch
        batch, length = frames.shape[0], frames.shape[1]
        codes_in, audio_out, finite, starts_in, (pin_codes, pin_audio, pin_finite, pin_starts) = self._buffers
        codes_per_frame = self.layout.codes_per_frame
        staged = pin_codes[:bucket * length * codes_per_frame].numpy().reshape(bucket, length, codes_per_frame)
        staged[:batch] = frames
        staged[batch:] = 0
        count = bucket * length * codes_per_frame
        samples = batch * self.span(length) * self.layout.samples_per_frame
        if starts is not None:
            pin_starts[:batch].numpy()[:] = starts
            pin_starts[batch:bucket].numpy()[:] = 0
        with torch.cuda.stream(self._stream):
            codes_in[:count].copy_(pin_codes[:count], non_blocking=True)
            if starts is not None:
                starts_in[:bucket].copy_(pin_starts[:bucket], non_blocking=True)
            self._graphs[(bucket, length)].replay()
            pin_audio[:samples].copy_(audio_out[:samples], non_blocking=True)
            pin_finite.copy_(finite, non_blocking=True)
            self._stream.synchronize()
        audio = pin_audio[:samples].numpy().reshape(batch, -1).copy()
        return cast(npt.NDArray[np.float32], audio), bool(pin_finite.item())

    def _eager(self, frames: CodeFrames, starts: npt.NDArray[np.int64] | None,
               model: Any) -> tuple[npt.NDArray[np.float32], bool]:
        torch = self._torch
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            codes = torch.from_numpy(np.ascontiguousarray(frames, dtype=np.int64)).to(self.device)
            audio = self._forward(codes, None if starts is None else torch.from_numpy(starts).to(self.device), model)
            finite = bool(torch.isfinite(audio).all()) if self.dtype != "float32" else True
            return cast(npt.NDArray[np.float32], audio.cpu().numpy()), finite


class SnacCodec(GraphedCodec):
    """A SNAC decoder loaded from a local folder (`GraphedCodec`). On a GPU (see `docs/engines.md`, "Codec on
    the GPU"): the decoder runs in `dtype` (`"auto"`: float16 on CUDA, float32 elsewhere) with its last layers
    (snake, output conv, tanh) in float32; a reduced-precision batch whose audio is not finite is decoded
    again in float32."""

    def __init__(self, model_dir: str | Path, device: str = "auto", dtype: str = "auto",
                 cuda_graphs: bool = True) -> None:
        self.model_dir = Path(model_dir)
        for name in ("config.json", "pytorch_model.bin"):
            if not (self.model_dir / name).is_file():
                raise FileNotFoundError(f"talker codec: {self.model_dir / name} is missing (--codec-model must be a "
                                        "SNAC folder: config.json + pytorch_model.bin)")
        super().__init__(device, dtype, cuda_graphs)
        self._tail: Any = None

    def load(self) -> None:
        """Build the model from `config.json`, load `pytorch_model.bin`, fold weight norm, move it to the
        device. Reads only the folder (no hub access)."""
        import torch
        from snac import SNAC

        config_path = self.model_dir / "config.json"
        weights_path = self.model_dir / "pytorch_model.bin"
        config = json.loads(config_path.read_text())
        if config.get("sampling_rate", 24000) != 24000 or list(config.get("vq_strides", [])) != [4, 2, 1]:
            raise ValueError("talker codec: expected a 24 kHz SNAC with vq_strides [4, 2, 1] (Orpheus' codec)")
        model = SNAC(**config)
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        for module in model.modules():
            if torch.nn.utils.parametrize.is_parametrized(module, "weight"):
                torch.nn.utils.parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
            if type(module).__name__ == "Snake1d":
                # SNAC's snake is a TorchScript function; the same arithmetic eagerly, so that CUDA graph
                # capture never meets the JIT's profiling runs or a fusion compiled mid-capture.
                module.forward = types.MethodType(_snake_forward, module)
        model.encoder = None  # decoding only
        device, dtype = self._resolve(torch)
        self.device, self.dtype = device, dtype
        model = model.to(device).eval()
        tail = copy.deepcopy(model.decoder.model[-3:])  # snake, output conv, tanh: kept in float32
        if dtype != "float32":
            self._model32 = copy.deepcopy(model)
            model = model.to(getattr(torch, dtype))
        self._model, self._tail, self._torch = model, tail, cast(Any, torch)
        if device.startswith("cuda"):
            self._stream = self._torch.cuda.Stream(device=device)

    def _forward(self, codes: Any, starts: Any = None, model: Any = None) -> Any:
        """Codes (batch, n, 7) int64 on the device -> float32 audio (batch, n * 2048); no host sync. SNAC decodes
        every frame (`starts` is always None: no `tail_frames`)."""
        torch = self._torch
        model = model if model is not None else self._model
        batch = codes.shape[0]
        levels = [codes[..., 0],
                  torch.stack((codes[..., 1], codes[..., 4]), -1).reshape(batch, -1),
                  torch.stack((codes[..., 2], codes[..., 3], codes[..., 5], codes[..., 6]), -1).reshape(batch, -1)]
        hidden = model.decoder.model[:-3](model.quantizer.from_codes(levels))
        return self._tail(hidden.float())[:, 0, :]


def _snake_forward(self: Any, x: Any) -> Any:
    """SNAC's `snake(x, alpha)`, the same arithmetic without TorchScript."""
    import torch

    alpha = self.alpha
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


@runtime_checkable
class CodecEngine(Protocol):
    """An engine that decodes its audio in voicewire's own codec path (the talker engine; the omni engine
    with `--omni-codec voicewire`): its batcher, None while it has none (not started, or another route)."""

    @property
    def codec_batcher(self) -> CodecBatcher | None: ...


def engine_codec(engine: object) -> CodecBatcher | None:
    """`engine`'s codec batcher (`CodecEngine`), or None for an engine without one."""
    return engine.codec_batcher if isinstance(engine, CodecEngine) else None


@dataclass(frozen=True, slots=True)
class CodecStats:
    """Codec work since start: decode calls (`batches`), windows decoded, the largest batch, frames, the
    decode time summed and at its worst (`decode_s`, `max_decode_ms`: the codec thread's call, copies and
    stream sync included), windows decoded after their deadline (`late`) and of those the ones queued before
    it (`late_in_codec`: the codec's queue and decode made them late; the rest were cut at or after their
    deadline, a unit's first chunk among them, due when cut). Beside them, where the units'
    time to their first chunk went (`CodecBatcher.first_chunk`), summed over `first_chunks` units: from the
    engine call to the first chunk's frames (`first_frames_s`: prompt, the talker's queue, prefill and first
    frames) and from there to its audio (`first_decode_s`: the codec's queue and decode)."""

    batches: int = 0
    windows: int = 0
    max_batch: int = 0
    frames: int = 0
    decode_s: float = 0.0
    max_decode_ms: float = 0.0
    late: int = 0
    late_in_codec: int = 0
    first_chunks: int = 0
    first_frames_s: float = 0.0
    first_decode_s: float = 0.0


@dataclass(slots=True)
class _Job:
    window: DecodeWindow
    deadline: float
    future: asyncio.Future[FloatAudio]
    times: list[float] | None
    length: int
    """The window's decoded length (`GraphedCodec.padded_length`)."""
    end: int
    """The window frame its chunk ends in (exclusive): where its decoded span ends (`GraphedCodec.span_start`)."""
    start: int
    """The first frame of its decoded span."""
    queued: float
    """When it was queued (`time.perf_counter()`)."""


class CodecBatcher:
    """Decodes windows from any number of concurrent requests, batching those of equal length.

    `decode(window, deadline)` queues the window and waits for its audio. One worker task decodes one batch
    at a time on the codec thread: of everything queued, the windows of the length whose most urgent window
    has the earliest deadline (`time.perf_counter()` seconds: when the listener's audio runs out; a unit's
    first chunk is due at once), up to `max_batch` windows and `max_batch_frames` frames of audio decoded
    (`GraphedCodec.span`: a window's chunk and the left context its late layers need), most urgent first.
    The frame cap bounds how long an urgent window can wait behind a batch already on the GPU (measured on
    the H200 in float16 graphs: 64 windows of 20 frames take 58 ms, 16 of them about 15 ms; the time is
    linear in frames, so splitting costs no GPU time). It re-reads the queue after
    every batch, so a first chunk queued meanwhile goes next, ahead of long windows with seconds of slack.
    Cancelling a waiter is safe at any time (its result is dropped). Memory: the queued windows' codes and
    one batch of audio.
    """

    ROW_SECONDS_HOLD = 0.8
    """Per batch, the weight the decode time per frame of audio decoded measured so far keeps against the newest
    one."""

    def __init__(self, codec: GraphedCodec, max_batch: int = 64, max_batch_frames: int = 320) -> None:
        self.codec = codec
        self.max_batch = max_batch
        self.max_batch_frames = max_batch_frames
        self.stats = CodecStats()
        self._queue: list[_Job] = []
        self._queued_rows = 0
        self._row_s: float | None = None
        self._in_flight: tuple[float, int] | None = None
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker on the running loop (the codec must be loaded)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="talker-codec")
        self._wake = asyncio.Event()
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="talker-codec")

    def backlog_s(self, now: float) -> float:
        """Estimated seconds of decoding ahead of a window queued at `now` (`time.perf_counter()`): what is left
        of the batch on the device and every window queued, at the measured decode time per frame of audio decoded
        (smoothed over batches; 0 until a batch has been decoded). An upper estimate for a window more urgent
        than some of the queue (earliest deadline goes first); constant time."""
        row_s = self._row_s
        if row_s is None:
            return 0.0
        left = 0.0
        if self._in_flight is not None:
            began, rows = self._in_flight
            left = max(0.0, began + rows * row_s - now)
        return left + self._queued_rows * row_s

    def first_chunk(self, called: float, cut: float, decoded: float) -> None:
        """Count a unit's first chunk in `stats`: the engine was called at `called`, the chunk's frames were
        cut at `cut` and its audio was decoded at `decoded` (`time.perf_counter()` seconds)."""
        s = self.stats
        self.stats = dataclasses.replace(s, first_chunks=s.first_chunks + 1,
                                         first_frames_s=s.first_frames_s + cut - called,
                                         first_decode_s=s.first_decode_s + decoded - cut)

    async def on_codec_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the codec thread (CUDA graph capture, warm-up), between batches."""
        if self._executor is None:
            raise RuntimeError("talker codec: batcher not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        for job in self._queue:
            job.future.cancel()
        self._queue.clear()
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True)

    async def decode(self, window: DecodeWindow, deadline: float | None = None,
                     times: list[float] | None = None) -> FloatAudio:
        """The window's output samples (`emit_start:emit_end` of its decoded audio). `deadline`
        (perf_counter seconds; default now) orders the work; `times`, if given, receives the
        perf_counter times its batch's decode started and ended. Raises ValueError for a chunk longer than the
        codec's span leaves room for after its context (`GraphedCodec.tail_frames`)."""
        if self._wake is None:
            raise RuntimeError("talker codec: batcher not started")
        length = self.codec.padded_length(len(window.frames))
        spf = self.codec.layout.samples_per_frame
        end = -(-window.emit_end // spf)
        start = self.codec.span_start(length, end)
        if start and window.emit_start < (start + self.codec.tail_context) * spf:
            raise ValueError(f"codec: a chunk of {window.chunk_frames} frames is longer than the "
                             f"{self.codec.tail_frames}-frame span less {self.codec.tail_context} frames of context")
        future: asyncio.Future[FloatAudio] = asyncio.get_running_loop().create_future()
        queued = time.perf_counter()
        self._queue.append(_Job(window, queued if deadline is None else deadline, future, times, length, end, start,
                                queued))
        self._queued_rows += self.codec.span(length)
        self._wake.set()
        return await future

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                self._queue = [job for job in self._queue if not job.future.done()]
                if not self._queue:
                    break
                length = min(self._queue, key=lambda job: job.deadline).length
                group = sorted((job for job in self._queue if job.length == length),
                               key=lambda job: job.deadline)[:self._batch_size(length)]
                taken = {id(job) for job in group}
                self._queue = [job for job in self._queue if id(job) not in taken]
                self._queued_rows = sum(self.codec.span(job.length) for job in self._queue)
                await self._decode_batch(loop, group)

    def _batch_size(self, length: int) -> int:
        return batch_size(self.codec.span(length), self.max_batch, self.max_batch_frames,
                          self.codec.graph_buckets(length))

    async def _decode_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Job]) -> None:
        codes = np.stack([padded(job.window.frames, job.length) for job in batch])
        length, spf = codes.shape[1], self.codec.layout.samples_per_frame
        ends = [job.end for job in batch]
        rows = len(batch) * self.codec.span(length)
        began = time.perf_counter()
        self._in_flight = (began, rows)
        try:
            audio = await loop.run_in_executor(self._executor, self.codec.decode, codes, ends)
        except Exception as exc:
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        finally:
            self._in_flight = None
        ended = time.perf_counter()
        per_row = (ended - began) / rows
        hold = self.ROW_SECONDS_HOLD
        self._row_s = per_row if self._row_s is None else hold * self._row_s + (1 - hold) * per_row
        late = [job for job in batch if job.deadline < ended]
        self._count(len(batch), codes.shape[0] * length, ended - began, len(late),
                    sum(1 for job in late if job.queued < job.deadline))
        for row, job in enumerate(batch):
            if job.times is not None:
                job.times += [began, ended]
            if not job.future.done():
                offset = job.start * spf
                job.future.set_result(audio[row, job.window.emit_start - offset:job.window.emit_end - offset])

    def _count(self, size: int, frames: int, seconds: float, late: int, late_in_codec: int) -> None:
        s = self.stats
        self.stats = dataclasses.replace(s, batches=s.batches + 1, windows=s.windows + size,
                                         max_batch=max(s.max_batch, size), frames=s.frames + frames,
                                         decode_s=s.decode_s + seconds,
                                         max_decode_ms=max(s.max_decode_ms, seconds * 1000.0), late=s.late + late,
                                         late_in_codec=s.late_in_codec + late_in_codec)
