"""The talker's codec side without vLLM: token parsing, the ramped chunk schedule, seam-free chunked
decoding with a random-init SNAC decoder, and batching across requests."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from voicewire.adapters.talker_codec import (
    ChunkPolicy,
    ChunkStreamer,
    CodecBatcher,
    DecodeWindow,
    FirstChunkSizer,
    SnacCodec,
    batch_size,
    capture_shapes,
    graph_plan,
)
from voicewire.adapters.talker_layout import (
    AUDIO_BASE,
    CODEBOOK_SIZE,
    END_OF_SPEECH,
    SAMPLES_PER_FRAME,
    START_OF_SPEECH,
    FrameParser,
)
from voicewire.adapters.talker_testing import write_snac

F = SAMPLES_PER_FRAME


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SnacCodec]:
    codec = SnacCodec(write_snac(Path(tmp_path_factory.mktemp("snac"))), device="cpu")
    codec.load()
    yield codec


def random_frames(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, size=(n, 7), dtype=np.int64)


def stream_windows(policy: ChunkPolicy, frames: np.ndarray, bursts: list[int], initial: int | None = None,
                   ) -> list[DecodeWindow]:
    streamer = ChunkStreamer(policy, initial or policy.initial_frames)
    windows, at = [], 0
    for size in bursts:
        windows += streamer.push(frames[at:at + size])
        at += size
    assert at == len(frames)
    return windows + streamer.finish()


def decode_chunked(codec: SnacCodec, windows: list[DecodeWindow]) -> np.ndarray:
    return np.concatenate([codec.decode(w.frames[None])[0, w.emit_start:w.emit_end] for w in windows])


def test_parser_reads_orpheus_slots_and_stops_at_end_of_speech() -> None:
    codes = random_frames(2, seed=3)
    tokens = [START_OF_SPEECH] + [AUDIO_BASE + (i % 7) * CODEBOOK_SIZE + int(c) for i, c in enumerate(codes.ravel())]
    parser = FrameParser()
    first = parser.feed(tokens[:5])
    assert first.shape == (0, 7)
    rest = parser.feed([*tokens[5:], AUDIO_BASE, END_OF_SPEECH, AUDIO_BASE])
    assert np.array_equal(rest, codes)
    assert parser.stopped and parser.slot_mismatches == 0 and parser.skipped == 1


def test_parser_folds_codes_emitted_in_the_wrong_slot() -> None:
    parser = FrameParser()
    frames = parser.feed([AUDIO_BASE + 6 * CODEBOOK_SIZE + 5] * 7)
    assert frames.tolist() == [[5] * 7]
    assert parser.slot_mismatches == 6


def test_schedule_ramps_from_the_first_chunk_and_covers_every_sample_once() -> None:
    policy = ChunkPolicy()
    frames = random_frames(100)
    one_by_one = stream_windows(policy, frames, [1] * 100)
    sizes = [1, 1, 1, 1, 2, 3, 4, 6, 9, 14, 16, 16, 16, 10]
    assert [w.chunk_frames for w in one_by_one] == sizes, "half the frames already sent, at least 1, at most 16"
    emitted = [w.emit_end - w.emit_start for w in one_by_one]
    assert emitted == [n * F for n in sizes], "every chunk is exactly its frames"
    # Chunks 0 and 1 start before `lookahead_from_frame`: their window ends with a copy of their last frame,
    # standing in for the future they do not wait for. Later ones wait for 1 real frame of lookahead.
    for window in one_by_one[:2]:
        assert np.array_equal(window.frames[-1], window.frames[-2])
        assert len(window.frames) == window.emit_end // F + policy.pad_frames
    assert [len(w.frames) - w.emit_end // F for w in one_by_one] == [1] * (len(sizes) - 1) + [0]
    bursty = stream_windows(policy, frames, [3, 1, 30, 2, 64])
    assert [(w.first_frame, w.emit_start, w.emit_end, len(w.frames)) for w in bursty] == \
        [(w.first_frame, w.emit_start, w.emit_end, len(w.frames)) for w in one_by_one], "timing never matters"


def test_first_chunk_size_follows_the_request() -> None:
    windows = stream_windows(ChunkPolicy(), random_frames(30), [30], initial=4)
    assert [w.chunk_frames for w in windows] == [4, 2, 3, 4, 6, 9, 2]
    assert windows[0].emit_end - windows[0].emit_start == 4 * F


def test_chunked_decoding_equals_whole_sequence_decoding(codec: SnacCodec) -> None:
    frames = random_frames(48, seed=1)
    whole = codec.decode(frames[None])[0]
    exact = ChunkPolicy(left_context_frames=3, lookahead_frames=3, lookahead_from_frame=0)
    exact_windows = [w for w in stream_windows(exact, frames, [1] * 48) if w.chunk_frames]
    chunked = decode_chunked(codec, exact_windows)
    assert len(chunked) == len(whole)
    assert np.abs(chunked - whole).max() < 1e-4, "with 3 frames of context both sides, seams are exact"

    default = decode_chunked(codec, stream_windows(ChunkPolicy(), frames, [1] * 48))
    assert len(default) == len(whole)
    assert np.linalg.norm(default - whole) / np.linalg.norm(whole) < 2e-2
    steady_from = 8 * F  # from frame 2 on, every chunk has its lookahead frame
    assert np.abs(default[steady_from:] - whole[steady_from:]).max() < 2e-2


@pytest.mark.parametrize("initial", [1, 2])
def test_a_stand_in_future_keeps_the_first_seam_smooth(codec: SnacCodec, initial: int) -> None:
    """The first chunk does not wait for the frame after it (that would cost time to first audio). Decoded
    with nothing after it, its last samples jump away from the whole-sequence decode, a click where the next
    chunk starts; a copy of its last frame in place of the future keeps that step small."""
    frames = random_frames(12, seed=initial)
    whole = codec.decode(frames[None])[0]
    seam = initial * F

    def seam_step(policy: ChunkPolicy) -> float:
        audio = decode_chunked(codec, stream_windows(policy, frames, [1] * 12, initial=initial))
        assert len(audio) == len(whole)
        return float(abs(audio[seam - 1] - whole[seam - 1]))

    padded, bare = seam_step(ChunkPolicy()), seam_step(ChunkPolicy(pad_frames=0))
    typical_step = float(np.abs(np.diff(whole)).mean())
    assert bare > typical_step, "with no future, the seam clicks"
    assert padded < bare / 4 and padded < typical_step / 2


def test_a_unit_that_ends_in_its_first_chunk_is_exact_when_its_end_is_known(codec: SnacCodec) -> None:
    """A 4-frame unit with a 4-frame first chunk: if its frames arrive marked final, nothing stands in for
    a future that does not exist, and the chunk equals the whole-sequence decode; cut before its end was
    known, it carries the stand-in."""
    frames = random_frames(4, seed=5)
    whole = codec.decode(frames[None])[0]
    final = ChunkStreamer(ChunkPolicy(), 4)
    windows = final.push(frames, final=True) + final.finish()
    assert [len(w.frames) for w in windows] == [4]
    assert np.abs(decode_chunked(codec, windows) - whole).max() < 1e-5
    early = ChunkStreamer(ChunkPolicy(), 4)
    windows = early.push(frames) + early.finish()
    assert [len(w.frames) for w in windows] == [5]
    assert len(decode_chunked(codec, windows)) == len(whole)


FRAME_S = SAMPLES_PER_FRAME / 24000


def paced_playback(policy: ChunkPolicy, frames: np.ndarray, rtf: float, decode_s: float | Callable[[float], float],
                   *, paced: bool = True, burst: int = 1, report: bool = False,
                   backlog: Callable[[float], float] | None = None, arrival: Callable[[int], float] | None = None,
                   initial: int | None = None) -> tuple[list[DecodeWindow], list[float]]:
    """A talker at real-time factor `rtf` (its frames arrive `burst` at a time, after a 30 ms prefill; or frame
    i at `arrival(i)`) through a streamer, each window heard `decode_s` after it is cut (or `decode_s(cut
    time)`: a load that changes; with `report`, each window's latency is reported to the streamer as the
    engine does; with `backlog`, each push is given `backlog(now)` as the codec's queued work, as the engine
    gives its batcher's estimate; `initial`: the first chunk's frames, default the policy's); returns the
    windows and the stalls (seconds) a player starting at the first chunk hears. Simulated time: no clock is
    read."""
    latency = decode_s if callable(decode_s) else (lambda _at: decode_s)
    streamer = ChunkStreamer(policy, initial or policy.initial_frames)
    cut: list[tuple[float, DecodeWindow]] = []
    now = 0.0
    for at in range(0, len(frames), burst):
        now = 0.03 + (at + burst - 1) * rtf * FRAME_S if arrival is None else arrival(at + burst - 1)
        chunk = frames[at:at + burst]
        final = at + burst >= len(frames)
        due = streamer.push(chunk, final=final, now=now if paced else None,
                            backlog_s=backlog(now) if backlog is not None else 0.0)
        if report:
            for _ in due:
                streamer.delivered(latency(now))
        cut += [(now, w) for w in due]
    cut += [(now, w) for w in streamer.finish()]
    stalls: list[float] = []
    playing_until: float | None = None
    for cut_at, window in cut:
        heard = cut_at + latency(cut_at)
        if playing_until is not None and heard > playing_until + 1e-9:
            stalls.append(heard - playing_until)
        playing_until = max(heard, playing_until or heard) + window.chunk_frames * FRAME_S
    return [w for _, w in cut], stalls


@pytest.mark.parametrize("rtf", [0.3, 0.7, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("burst", [1, 3])
def test_a_paced_schedule_never_lets_the_listener_run_dry_while_the_talker_keeps_up(rtf: float, burst: int) -> None:
    """Paced by the listener's clock, a chunk goes out before the audio ahead of it has played for any
    real-time factor under 1 (codec and delivery within the margin); the frame-count ramp alone runs dry
    past a factor of about 0.66, which is what 128 sessions on one H200 reached."""
    policy = ChunkPolicy()
    frames = random_frames(115)
    windows, stalls = paced_playback(policy, frames, rtf, decode_s=0.05, burst=burst)
    assert stalls == []
    assert sum(w.chunk_frames for w in windows) == 115
    assert windows[0].chunk_frames == policy.initial_frames, "time to first audio is not traded"
    if rtf >= 0.8:
        _, ramp_stalls = paced_playback(policy, frames, rtf, decode_s=0.05, paced=False, burst=burst)
        assert ramp_stalls, "the unpaced ramp runs dry at this speed"


@pytest.mark.parametrize("rtf", [0.5, 0.6, 0.7])
def test_the_margin_follows_the_codecs_measured_delivery_as_load_grows(rtf: float) -> None:
    """Sessions join and the codec's batches grow: a chunk's cut -> decoded latency climbs from 30 to 200 ms
    over the first second, past the fixed margin, and the listener runs dry; with each chunk's latency
    reported (as the engine does), the margin follows it and no chunk is late."""
    policy = ChunkPolicy()
    frames = random_frames(115)

    def load(at: float) -> float:
        return 0.03 + 0.17 * min(at, 1.0)

    _, blind = paced_playback(policy, frames, rtf, load)
    windows, stalls = paced_playback(policy, frames, rtf, load, report=True)
    assert blind, "the fixed margin is too small for this load"
    assert stalls == []
    assert windows[0].chunk_frames == policy.initial_frames
    assert sum(w.chunk_frames for w in windows) == 115


@pytest.mark.parametrize("rtf", [0.5, 0.6, 0.7])
def test_the_margin_meets_a_codec_backlog_as_it_forms(rtf: float) -> None:
    """Many sessions cut together a second in: for half a second the codec's queue holds 250 ms of work
    ahead of any new window. The held peak of earlier latencies has not seen it, and the listener runs dry;
    given the backlog with each push (as the engine gives its batcher's estimate), the stream cuts early
    enough, at about the same codec work."""
    policy = ChunkPolicy()
    frames = random_frames(115)

    def backlog(at: float) -> float:
        return 0.25 if 1.0 <= at < 1.5 else 0.0

    def load(at: float) -> float:
        return 0.03 + backlog(at)

    held, held_stalls = paced_playback(policy, frames, rtf, load, report=True)
    windows, stalls = paced_playback(policy, frames, rtf, load, report=True, backlog=backlog)
    assert held_stalls, "the held peak alone is blind to a backlog that forms at once"
    assert stalls == []
    assert len(windows) <= len(held) + 2
    assert windows[0].chunk_frames == policy.initial_frames
    assert sum(w.chunk_frames for w in windows) == 115


def test_a_fast_talker_gets_larger_chunks_sooner() -> None:
    """With audio in hand, a chunk grows past the ramp as far as the talker can fill it in time: fewer codec
    windows for the same unit, none of them late."""
    frames = random_frames(115)
    paced, stalls = paced_playback(ChunkPolicy(), frames, 0.3, decode_s=0.05)
    ramp, _ = paced_playback(ChunkPolicy(), frames, 0.3, decode_s=0.05, paced=False)
    assert stalls == [] and len(paced) < len(ramp)
    assert max(w.chunk_frames for w in paced) <= ChunkPolicy().steady_frames


def test_a_talker_slower_than_real_time_gets_no_more_codec_windows_than_the_ramp() -> None:
    """Behind real time the listener hears gaps whatever the schedule; cutting every frame as it comes would
    multiply codec work on a device that is already the bottleneck."""
    frames = random_frames(115)
    paced, _ = paced_playback(ChunkPolicy(), frames, 1.3, decode_s=0.05)
    ramp, _ = paced_playback(ChunkPolicy(), frames, 1.3, decode_s=0.05, paced=False)
    assert len(paced) <= len(ramp) + 2


def test_a_talker_slow_for_a_few_steps_still_gets_early_cuts() -> None:
    """A fast talker (30 ms a frame) slows to 150 ms a frame for 6 steps (a burst's prefill, as at 64 sessions
    of the omni duel): its smoothed pace passes real time, but over the unit it is well ahead, and the
    listener's buffer is what early cuts protect. Waiting for ramp-sized chunks at the slow pace runs it dry;
    with early cuts it never does."""
    frames = random_frames(60)

    def arrival(index: int) -> float:
        return 0.03 + 0.03 * index + 0.12 * min(max(index - 10, 0), 6)

    windows, stalls = paced_playback(ChunkPolicy(), frames, 0.0, decode_s=0.05, report=True, arrival=arrival)
    _, ramp_stalls = paced_playback(ChunkPolicy(), frames, 0.0, decode_s=0.05, paced=False, arrival=arrival)
    assert ramp_stalls, "ramp-sized chunks run dry in the slow steps"
    assert stalls == []
    assert sum(w.chunk_frames for w in windows) == 60


def test_the_first_chunk_is_sized_by_the_measured_step_and_latency() -> None:
    """`FirstChunkSizer`: an idle engine's first chunk is the floor; once the talker's steps (75 ms a frame) and
    the codec's latency (60 ms) together pass a frame's audio, two frames; never past the cap, never below a
    larger floor."""
    sizer = FirstChunkSizer(FRAME_S, cap=4)
    assert sizer.first_chunk_frames(1) == 1
    for _ in range(8):
        sizer.arrived(0.02, 1)
        sizer.delivered(0.01)
    assert sizer.first_chunk_frames(1) == 1, "light load: one frame"
    for _ in range(60):
        sizer.arrived(0.15, 2)
        sizer.delivered(0.06)
    assert sizer.first_chunk_frames(1) == 2
    assert sizer.first_chunk_frames(3) == 3
    for _ in range(60):
        sizer.arrived(0.5, 1)
    assert sizer.first_chunk_frames(1) == 4, "capped"


def test_a_first_chunk_sized_by_the_load_plays_until_the_second_follows() -> None:
    """Steps of 75 ms (under a frame's 85 ms), a chunk cut at the first frame decoded in 30 ms (the codec's most
    urgent window) and every later one in 60: one frame runs dry before the second chunk arrives; the two
    frames the sizer asks for do not."""
    frames = random_frames(40)

    def decode_s(at: float) -> float:
        return 0.03 if at < 0.05 else 0.06

    sizer = FirstChunkSizer(FRAME_S, cap=4)
    for _ in range(60):
        sizer.arrived(0.075, 1)
        sizer.delivered(0.06)
    _, one = paced_playback(ChunkPolicy(), frames, 0.075 / FRAME_S, decode_s, report=True)
    windows, sized = paced_playback(ChunkPolicy(), frames, 0.075 / FRAME_S, decode_s, report=True,
                                    initial=sizer.first_chunk_frames(1))
    assert one, "one frame runs dry"
    assert sized == [] and windows[0].chunk_frames == 2


def test_paced_chunks_decode_like_the_whole_sequence(codec: SnacCodec) -> None:
    """Chunks cut early for a slow talker end on a stand-in future, as first chunks do: the stream stays
    within the schedule's seam tolerance of the whole-sequence decode."""
    frames = random_frames(48, seed=7)
    whole = codec.decode(frames[None])[0]
    windows, stalls = paced_playback(ChunkPolicy(), frames, 0.9, decode_s=0.05)
    assert stalls == [] and any(w.chunk_frames == 1 for w in windows[3:])
    audio = decode_chunked(codec, windows)
    assert len(audio) == len(whole)
    assert np.linalg.norm(audio - whole) / np.linalg.norm(whole) < 2e-2


def test_chunks_without_left_context_click_at_the_seams(codec: SnacCodec) -> None:
    """The reason for the context: decoding chunks on their own leaves a large jump at every seam."""
    frames = random_frames(16, seed=2)
    whole = codec.decode(frames[None])[0]
    naive = np.concatenate([codec.decode(frames[None, i:i + 4])[0] for i in range(0, 16, 4)])
    seam = slice(4 * F - 64, 4 * F + 64)
    assert np.abs(naive[seam] - whole[seam]).max() > 10 * np.abs(
        decode_chunked(codec, stream_windows(ChunkPolicy(), frames, [1] * 16))[seam] - whole[seam]).max()


async def test_batcher_estimates_the_work_queued_ahead_of_a_new_window(codec: SnacCodec) -> None:
    """`backlog_s` is 0 until a batch has been timed and when the queue is empty; with windows queued it
    is their frames at the measured decode time per window frame, and it falls to 0 once they are done."""
    batcher = CodecBatcher(codec)
    batcher.start()
    try:
        assert batcher.backlog_s(time.perf_counter()) == 0.0
        await batcher.decode(DecodeWindow(0, random_frames(5, seed=1), 0, 5 * F, 5))
        assert batcher.backlog_s(time.perf_counter()) == 0.0
        windows = [DecodeWindow(0, random_frames(n, seed=n), 0, n * F, n) for n in (4, 4, 5, 6)]
        pending = asyncio.gather(*(batcher.decode(w) for w in windows))
        await asyncio.sleep(0)  # the decodes queue; the worker has not taken a batch yet
        per_frame = batcher.backlog_s(time.perf_counter()) / sum(len(w.frames) for w in windows)
        assert per_frame > 0
        await pending
        assert batcher.backlog_s(time.perf_counter()) == 0.0
        assert batcher.stats.windows == 5
    finally:
        await batcher.close()
    timed = batcher.stats.decode_s / batcher.stats.frames
    assert timed / 10 < per_frame < timed * 10, "the estimate is the measured decode time per window frame"


async def test_batcher_tells_windows_the_codec_made_late_from_windows_cut_late(codec: SnacCodec) -> None:
    """A window queued after its deadline (a first chunk: due when cut) counts as late, not in the codec; one
    queued while its deadline was still ahead and decoded after it counts as both; one decoded in time, as
    neither."""
    batcher = CodecBatcher(codec)
    batcher.start()
    try:
        window = DecodeWindow(0, random_frames(5, seed=1), 0, 5 * F, 5)
        await batcher.decode(window)  # due at once: decoded after its deadline, cut at it
        assert (batcher.stats.late, batcher.stats.late_in_codec) == (1, 0)
        busy = asyncio.ensure_future(batcher.on_codec_thread(time.sleep, 0.05))  # the codec thread, for 50 ms
        await asyncio.sleep(0)
        await batcher.decode(window, time.perf_counter() + 0.01)  # ahead when queued, past once decoded
        await busy
        assert (batcher.stats.late, batcher.stats.late_in_codec) == (2, 1)
        await batcher.decode(window, time.perf_counter() + 60.0)
        assert (batcher.stats.late, batcher.stats.late_in_codec) == (2, 1)
    finally:
        await batcher.close()


async def test_batcher_decodes_concurrent_windows_of_equal_length_together(codec: SnacCodec) -> None:
    batcher = CodecBatcher(codec)
    batcher.start()
    try:
        windows = [DecodeWindow(0, random_frames(5, seed=s), 100, 3 * F, 5) for s in range(6)]
        odd = DecodeWindow(0, random_frames(2, seed=9), 0, 2 * F, 2)
        results = await asyncio.gather(*(batcher.decode(w) for w in [*windows, odd]))
    finally:
        await batcher.close()
    assert batcher.stats.max_batch == 6 and batcher.stats.batches == 2 and batcher.stats.windows == 7
    for window, audio in zip([*windows, odd], results, strict=True):
        alone = codec.decode(window.frames[None])[0, window.emit_start:window.emit_end]
        assert np.abs(audio - alone).max() < 1e-5


def test_graph_plan_captures_the_largest_shapes_first() -> None:
    """Every length with every bucket below the largest batch and the largest batch itself, ordered by
    batch x length descending, so smaller captures can reuse the memory the larger ones freed."""
    plan = graph_plan([20, 4, 20], 48, SnacCodec.GRAPH_BATCHES)
    assert sorted(plan) == sorted((b, n) for n in (4, 20) for b in (1, 2, 4, 8, 16, 32, 48))
    assert plan[0] == (48, 20) and plan[-1] == (1, 4)
    assert [b * n for b, n in plan] == sorted((b * n for b, n in plan), reverse=True)


def test_graph_plan_under_a_frame_cap_leaves_out_only_shapes_no_batch_takes() -> None:
    """With the batcher's frame cap, the plan keeps every shape a batch of that cap can use and no larger one
    (a window longer than the cap still gets batch 1): the batches `batch_size` forms are the same as with
    every shape captured, and the largest graphs (the memory) are gone."""
    lengths, cap = (1, 2, 4, 8, 16, 32, 64, 97), 388
    capped = graph_plan(lengths, 64, SnacCodec.GRAPH_BATCHES, cap)
    full = graph_plan(lengths, 64, SnacCodec.GRAPH_BATCHES)
    assert set(capped) < set(full) and max(b * n for b, n in capped) == 388 and capped[0] == (4, 97)
    assert (64, 4) in capped and (1, 500) in graph_plan([500], 64, SnacCodec.GRAPH_BATCHES, cap)
    for n in lengths:
        with_cap = sorted(b for b, m in capped if m == n)
        uncapped = sorted(b for b, m in full if m == n)
        assert batch_size(n, 64, cap, with_cap) == batch_size(n, 64, cap, uncapped)


class OutOfMemory(Exception):
    """Stands in for `torch.OutOfMemoryError`, which only a CUDA capture raises."""


def test_a_graph_out_of_memory_skips_that_shape_and_keeps_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    """Capturing in plan order against a memory limit (a fault-injecting capture: batch x frames above 300
    does not fit): the shapes that fit are all captured, each tried once, and the ones left out are logged."""
    caplog.set_level(logging.WARNING, logger="voicewire.talker")  # whatever level the root logger was left at
    plan = graph_plan([10, 20], 64, SnacCodec.GRAPH_BATCHES)
    tried: list[tuple[int, int]] = []

    def capture(batch: int, frames: int) -> str:
        tried.append((batch, frames))
        if batch * frames > 300:
            raise OutOfMemory
        return f"graph {batch}x{frames}"

    graphs = capture_shapes(plan, capture, OutOfMemory)
    assert tried == plan
    assert set(graphs) == {(b, n) for b, n in plan if b * n <= 300}
    assert graphs[(16, 10)] == "graph 16x10"
    assert "out of GPU memory for 5 of 14 CUDA graphs" in caplog.text


def test_a_capture_that_fails_otherwise_stops_and_keeps_what_was_captured(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="voicewire.talker")
    plan = graph_plan([4], 8, SnacCodec.GRAPH_BATCHES)  # (8, 4), (4, 4), (2, 4), (1, 4)

    def capture(batch: int, frames: int) -> int:
        if batch == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        return batch

    assert capture_shapes(plan, capture, OutOfMemory) == {(8, 4): 8, (4, 4): 4}
    assert "capture failed at (batch, frames) (2, 4); 2 of 4 shapes captured" in caplog.text


def test_batches_stay_within_the_shapes_the_codec_captured() -> None:
    """A batch never exceeds `max_batch` windows or `max_batch_frames` frames, is rounded down to a captured
    graph's batch for its length, and with no graph for the length to the standard buckets."""
    assert batch_size(20, 64, 320, ()) == 16  # 320 frames / 20 = 16 windows
    assert batch_size(4, 64, 320, ()) == 64
    assert batch_size(4, 48, 320, ()) == 48  # the batcher's own maximum is a bucket too
    assert batch_size(4, 64, 320, (1, 2, 4, 8, 16, 32, 64)) == 64
    # the largest shapes ran out of memory at capture: batches of the captured sizes, not eager ones
    assert batch_size(4, 64, 320, (1, 2, 4, 8, 16)) == 16
    assert batch_size(20, 64, 320, (1, 2, 4, 8)) == 8
    assert batch_size(400, 64, 320, (1, 2)) == 1  # one window, even over the frame cap
