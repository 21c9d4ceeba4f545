"""Qwen3-TTS' 12 Hz decoder in voicewire's own codec path (`adapters/omni_codec.py`), on the tiny test model's
speech tokenizer (`adapters/omni_testing.py`): batched and chunked decoding against vllm-omni's own whole
decoding with the same decoder, weights read from a real safetensors file, and `CodecBatcher` batching the
windows of concurrent streams."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm_omni", reason="vllm-omni is not installed (extra omni-cpu, docs/engines.md)")

import torch
from safetensors.torch import save_file
from voicewire.adapters import omni_frames
from voicewire.adapters.omni_codec import QWEN3_LAYOUT, QWEN3_POLICY, Qwen3Codec, conv_context_frames
from voicewire.adapters.omni_frames import FrameRouter
from voicewire.adapters.omni_testing import write_qwen3_tts
from voicewire.adapters.talker_codec import ChunkStreamer, CodecBatcher, DecodeWindow

CODES = 16
SPF = QWEN3_LAYOUT.samples_per_frame
TOLERANCE = 1e-5
"""Largest sample difference allowed between chunked and whole decoding (float32 rounding: the tiny decoder
agrees to about 1e-8 with 8 or more frames of left context)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_tts(tmp_path_factory.mktemp("qwen3") / "model", "custom_voice")


@pytest.fixture(scope="module")
def codec(model: Path) -> Iterator[Qwen3Codec]:
    torch.manual_seed(7)
    codec = Qwen3Codec(model, device="cpu", random_weights=True)
    codec.load()
    with torch.no_grad():  # the decoder's own init leaves some layers at zero: speech-like scales throughout
        for parameter in codec._model.parameters():
            parameter.normal_(0.0, 0.05)
    codec._model.precompute_snake_caches()  # its activations cache functions of their weights
    yield codec


def random_frames(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, size=(n, CODES), dtype=np.int64)


def vllm_omni_whole(codec: Qwen3Codec, frames: np.ndarray) -> np.ndarray:
    """vllm-omni's own decoding of a whole sequence with the same decoder (its stateless `chunked_decode`,
    the code2wav stage's path for a finished request)."""
    with torch.inference_mode():
        wav = codec._model.chunked_decode(torch.from_numpy(frames.T[None].copy()))
    return np.asarray(wav[0, 0].float().numpy())


def streamed(frames: np.ndarray, bursts: list[int], paced_s: float | None = None,
             context: np.ndarray | None = None) -> list[DecodeWindow]:
    streamer = ChunkStreamer(QWEN3_POLICY, QWEN3_POLICY.initial_frames, layout=QWEN3_LAYOUT)
    if context is not None:
        streamer.context(context)
    windows: list[DecodeWindow] = []
    at, now = 0, 0.0
    for size in bursts:
        now += (paced_s or 0.0) * size
        windows += streamer.push(frames[at:at + size], final=at + size == len(frames),
                                 now=now if paced_s is not None else None)
        at += size
    return windows + streamer.finish()


def test_a_batch_decodes_each_row_as_it_decodes_alone(codec: Qwen3Codec) -> None:
    frames = np.stack([random_frames(12, seed) for seed in range(3)])
    batch = codec.decode(frames)
    assert batch.shape == (3, 12 * SPF) and batch.dtype == np.float32
    assert 0.0 < float(np.abs(batch).max()) <= 1.0, "audio, clamped to [-1, 1] like vllm-omni's"
    for row in range(3):
        np.testing.assert_allclose(batch[row], codec.decode(frames[row:row + 1])[0], atol=TOLERANCE)


@pytest.mark.parametrize("bursts", [[1] * 90, [3, 1, 30, 2, 54], [90]], ids=["frame by frame", "bursts", "at once"])
def test_chunks_decoded_with_left_context_equal_vllm_omnis_whole_decode(codec: Qwen3Codec, bursts: list[int]) -> None:
    frames = random_frames(90, seed=1)
    windows = streamed(frames, bursts)
    assert windows[0].chunk_frames == 1, "the first chunk is one frame (80 ms)"
    assert all(len(w.frames) * SPF == w.emit_end + 0 for w in windows), "causal: no lookahead, no stand-in frames"
    assert sum(w.chunk_frames for w in windows) == 90
    chunked = np.concatenate([codec.decode(w.frames[None])[0, w.emit_start:w.emit_end] for w in windows])
    whole = vllm_omni_whole(codec, frames)
    assert chunked.shape == whole.shape == (90 * SPF,)
    assert float(np.abs(chunked - whole).max()) <= TOLERANCE


def test_paced_chunks_grow_with_the_talkers_lead_and_stay_seamless(codec: Qwen3Codec) -> None:
    frames = random_frames(120, seed=2)
    windows = streamed(frames, [1] * 120, paced_s=0.02)  # a talker at 4x real time
    sizes = [w.chunk_frames for w in windows]
    assert sizes[0] == 1 and max(sizes) == QWEN3_POLICY.steady_frames and len(windows) < 20
    chunked = np.concatenate([codec.decode(w.frames[None])[0, w.emit_start:w.emit_end] for w in windows])
    assert float(np.abs(chunked - vllm_omni_whole(codec, frames)).max()) <= TOLERANCE


@pytest.mark.parametrize("paced_s", [None, 0.02], ids=["ramp", "paced"])
def test_a_reference_is_left_context_that_no_chunk_covers(codec: Qwen3Codec, paced_s: float | None) -> None:
    """A clone's reference codes given first (`ChunkStreamer.context`): the schedule is the unit's own (first
    chunk one frame, the same chunk sizes as without them), the first windows reach back into the reference,
    and the chunks equal the part after the reference of one whole decode of reference and frames."""
    reference, frames = random_frames(30, seed=4), random_frames(60, seed=5)
    windows = streamed(frames, [1] * 60, paced_s, context=reference)
    plain = streamed(frames, [1] * 60, paced_s)
    assert [w.chunk_frames for w in windows] == [w.chunk_frames for w in plain] and windows[0].chunk_frames == 1
    assert windows[0].first_frame == -30 and windows[0].emit_start == 30 * SPF
    chunked = np.concatenate([codec.decode(w.frames[None])[0, w.emit_start:w.emit_end] for w in windows])
    whole = vllm_omni_whole(codec, np.concatenate([reference, frames]))[30 * SPF:]
    assert chunked.shape == whole.shape == (60 * SPF,)
    assert float(np.abs(chunked - whole).max()) <= TOLERANCE
    late = ChunkStreamer(QWEN3_POLICY, 1, layout=QWEN3_LAYOUT)
    late.push(frames[:1])
    with pytest.raises(RuntimeError, match="before the unit's first frames"):
        late.context(reference)


def test_a_held_first_chunk_waits_for_its_frames_and_takes_them_all(codec: Qwen3Codec) -> None:
    """`hold_first` (other units' prompts wait for the talker's prefill): no first chunk is cut before
    `held_first_frames` (4 for Qwen3: 320 ms to play through the burst's prefill steps); then it covers every
    frame in hand; the rest of the schedule and the seams are as without the hold."""
    assert QWEN3_POLICY.held_first_frames == 4
    frames = random_frames(40, seed=6)
    streamer = ChunkStreamer(QWEN3_POLICY, QWEN3_POLICY.initial_frames, layout=QWEN3_LAYOUT)
    assert streamer.push(frames[:1], now=0.0, hold_first=True) == []
    assert streamer.push(frames[1:3], now=0.1, hold_first=True) == []
    first = streamer.push(frames[3:5], now=0.2, hold_first=True)
    assert [w.chunk_frames for w in first] == [5] and first[0].first_frame == 0
    windows = first + [w for i in range(5, 40) for w in streamer.push(frames[i:i + 1], final=i == 39,
                                                                         now=0.2 + 0.02 * i, hold_first=True)]
    windows += streamer.finish()
    assert sum(w.chunk_frames for w in windows) == 40
    chunked = np.concatenate([codec.decode(w.frames[None])[0, w.emit_start:w.emit_end] for w in windows])
    assert float(np.abs(chunked - vllm_omni_whole(codec, frames)).max()) <= TOLERANCE


def test_a_hold_that_ends_cuts_the_first_chunk_with_the_frames_in_hand() -> None:
    """Once no other unit waits for its first frame (`hold_first` false), a held first chunk goes out with the
    frames it has, fewer than `held_first_frames`; a request's larger first chunk is held one frame past it."""
    streamer = ChunkStreamer(QWEN3_POLICY, QWEN3_POLICY.initial_frames, layout=QWEN3_LAYOUT)
    assert streamer.push(random_frames(2, seed=9), now=0.0, hold_first=True) == []
    assert [w.chunk_frames for w in streamer.push(random_frames(1, seed=10), now=0.07)] == [3]
    larger = ChunkStreamer(QWEN3_POLICY, 5, layout=QWEN3_LAYOUT)
    assert larger.push(random_frames(5, seed=11), now=0.0, hold_first=True) == []
    assert [w.chunk_frames for w in larger.push(random_frames(1, seed=12), now=0.07, hold_first=True)] == [6]


def test_a_held_first_chunk_goes_out_at_once_when_its_frames_end_the_unit() -> None:
    streamer = ChunkStreamer(QWEN3_POLICY, QWEN3_POLICY.initial_frames, layout=QWEN3_LAYOUT)
    windows = streamer.push(random_frames(1, seed=7), final=True, now=0.0, hold_first=True)
    assert [w.chunk_frames for w in windows] == [1]
    unheld = ChunkStreamer(QWEN3_POLICY, QWEN3_POLICY.initial_frames, layout=QWEN3_LAYOUT)
    assert [w.chunk_frames for w in unheld.push(random_frames(3, seed=8), now=0.0)][:1] == [1], \
        "without a hold the first chunk is one frame, however many are in hand"


async def test_the_frame_router_counts_the_units_no_frame_has_arrived_for() -> None:
    """`FrameRouter.unstarted` (what holds a first chunk, `OmniEngine._synthesize_own`), over its real socket:
    a claimed ticket counts until its first frame arrives (a reference before it does not count as one), its
    end, or its release."""
    router = await FrameRouter.open()
    talker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        (a, queue_a), (b, queue_b), (c, _) = router.claim(), router.claim(), router.claim()
        assert router.unstarted == 3
        talker.sendto(omni_frames.encode(a, 2, list(range(2 * CODES)), omni_frames.REFERENCE), router.path)
        await queue_a.get()
        assert router.unstarted == 3, "a reference is not a frame"
        talker.sendto(omni_frames.encode(a, 0, list(range(CODES))), router.path)
        talker.sendto(omni_frames.encode(b, 0, None), router.path)
        await queue_a.get()
        await queue_b.get()
        assert router.unstarted == 1
        router.release(c)
        assert router.unstarted == 0 and router.claimed == 2
    finally:
        talker.close()
        router.close()


async def test_the_frame_router_drops_malformed_and_unclaimed_datagrams_and_keeps_routing(
        caplog: pytest.LogCaptureFixture) -> None:
    """A datagram too short for a header, reference codes that do not divide into their frames, and frames for
    a released ticket are dropped; the frames after them still reach their unit, and the malformed ones are
    logged once (a sender's bug), not once per datagram."""
    router = await FrameRouter.open()
    talker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        (a, queue_a), (gone, _) = router.claim(), router.claim()
        router.release(gone)
        with caplog.at_level(logging.WARNING, logger="voicewire.adapters.omni_frames"):
            talker.sendto(b"\x01", router.path)
            talker.sendto(omni_frames.encode(a, 3, list(range(2 * CODES)), omni_frames.REFERENCE), router.path)
            talker.sendto(omni_frames.encode(gone, 0, list(range(CODES))), router.path)
            talker.sendto(omni_frames.encode(a, 0, list(range(CODES))), router.path)
            index, codes = await asyncio.wait_for(queue_a.get(), 5)
        assert index == 0 and codes is not None and codes.tolist() == list(range(CODES))
        assert queue_a.empty() and router.unstarted == 0
        assert [r.levelno for r in caplog.records if "malformed" in r.getMessage()] == [logging.WARNING]
    finally:
        talker.close()
        router.close()


def test_weights_are_read_from_the_speech_tokenizers_safetensors(model: Path, codec: Qwen3Codec,
                                                                 tmp_path: Path) -> None:
    folder = tmp_path / "model"
    (folder / "speech_tokenizer").mkdir(parents=True)
    (folder / "speech_tokenizer" / "config.json").write_text((model / "speech_tokenizer" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        Qwen3Codec(folder, device="cpu").load()
    state = {f"decoder.{name}": tensor.contiguous() for name, tensor in codec._model.state_dict().items()}
    state["encoder.unused"] = torch.zeros(1)  # the encoder's tensors share the file and are skipped
    save_file(state, str(folder / "speech_tokenizer" / "model.safetensors"))
    loaded = Qwen3Codec(folder, device="cpu")
    loaded.load()
    frames = random_frames(10, seed=3)[None]
    np.testing.assert_array_equal(loaded.decode(frames), codec.decode(frames))


def test_a_folder_without_a_12hz_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="speech_tokenizer"):
        Qwen3Codec(tmp_path)
    (tmp_path / "speech_tokenizer").mkdir()
    (tmp_path / "speech_tokenizer" / "config.json").write_text('{"model_type": "qwen3_tts_tokenizer_25hz"}')
    with pytest.raises(ValueError, match="not the 12 Hz one"):
        Qwen3Codec(tmp_path, device="cpu", random_weights=True).load()


async def test_the_batcher_decodes_concurrent_streams_windows_together(codec: Qwen3Codec) -> None:
    batcher = CodecBatcher(codec, max_batch=8)
    batcher.start()
    try:
        streams = [streamed(random_frames(40, seed), [40]) for seed in range(6)]
        firsts = await asyncio.gather(*(batcher.decode(windows[0]) for windows in streams))
    finally:
        await batcher.close()
    assert batcher.stats.max_batch > 1, "equal-length windows of different streams share a decode call"
    for windows, audio in zip(streams, firsts, strict=True):
        expected = codec.decode(windows[0].frames[None])[0, windows[0].emit_start:windows[0].emit_end]
        np.testing.assert_allclose(audio, expected, atol=TOLERANCE)


async def test_windows_are_padded_at_their_end_to_the_next_prepared_length(codec: Qwen3Codec) -> None:
    """The decoder is causal: windows of 3, 4 and 14 frames, padded with copies of their last frame to the
    prepared lengths 4 and 16, decode in two calls (3 and 4 together) to exactly their own samples."""
    windows = [DecodeWindow(0, random_frames(n, seed), 0, n * SPF, n) for seed, n in enumerate((3, 4, 14))]
    codec.prepare((1, 2, 4, 8, 16), max_batch=4)
    batcher = CodecBatcher(codec, max_batch=4, max_batch_frames=64)
    batcher.start()
    try:
        assert [codec.padded_length(n) for n in (1, 3, 4, 14, 16, 17)] == [1, 4, 4, 16, 16, 17]
        audio = await asyncio.gather(*(batcher.decode(window) for window in windows))
    finally:
        await batcher.close()
        codec.prepare((), max_batch=4)
    assert batcher.stats.batches == 2 and batcher.stats.frames == 2 * 4 + 16
    for window, got in zip(windows, audio, strict=True):
        assert got.shape == (len(window.frames) * SPF,)
        np.testing.assert_allclose(got, codec.decode(window.frames[None])[0], atol=TOLERANCE)


def test_a_span_decodes_its_chunk_as_the_whole_window_does(codec: Qwen3Codec) -> None:
    """Given chunk ends, windows longer than `tail_frames` decode only the span up to each chunk's end, in one
    batch whatever each row's span: a full window (72 frames of context, a 25-frame chunk), a window whose
    chunk ends early (end padding after it) and one whose chunk ends within the first span (from frame 0). The
    chunk's samples equal the whole window's decode; frames with less than the convolutions' context before
    them in the span do not, which is why the span carries it.

    The context by hand: the two ConvNeXt blocks' kernel-7 convolutions at 2 and 4 samples a frame (3 + 1.5
    frames), the decoder's first convolution at 4 (1.5), per upsampling block its transposed convolution (one
    input back) and three residual kernel-7 convolutions dilated 1, 3, 9 (78 samples) at 4 -> 32, 32 -> 160,
    160 -> 640 and 640 -> 1920 samples a frame, and the last kernel-7 convolution: 9.38 frames."""
    by_hand = 3 + 1.5 + 1.5 + sum(1 / rate_in + 78 / rate_out
                                   for rate_in, rate_out in ((4, 32), (32, 160), (160, 640), (640, 1920))) + 6 / 1920
    assert math.ceil(by_hand) == conv_context_frames(codec._model) == codec.tail_context == 10
    assert codec.tail_frames == QWEN3_POLICY.steady_frames + 10 == 35
    windows = np.stack([random_frames(97, seed) for seed in range(3)])
    chunks = [(72, 97), (40, 55), (5, 20)]
    spans = codec.decode(windows, [end for _, end in chunks])
    whole = codec.decode(windows)
    assert spans.shape == (3, 35 * SPF) and whole.shape == (3, 97 * SPF)
    for row, (first, end) in enumerate(chunks):
        start = codec.span_start(97, end)
        assert start == max(end - 35, 0)
        np.testing.assert_allclose(spans[row, (first - start) * SPF:(end - start) * SPF],
                                   whole[row, first * SPF:end * SPF], atol=TOLERANCE)
    short = spans[0, :2 * SPF] - whole[0, 62 * SPF:64 * SPF]  # frames 62-63: no context in the span
    assert np.abs(short).max() > 100 * TOLERANCE


async def test_the_batcher_decodes_long_windows_by_their_spans(codec: Qwen3Codec) -> None:
    """A stream long enough for full windows, through the batcher on a codec prepared with the engine's
    lengths: every chunk equals vllm-omni's whole decoding, while the batcher counts the spans' frames as its
    work; a chunk too long for the span after its context is refused."""
    frames = random_frames(160, 3)
    windows = streamed(frames, [1, 3, 8, 20, 40, 40, 48])
    codec.prepare((1, 2, 4, 8, 16, 32, 64, 97), max_batch=4)
    batcher = CodecBatcher(codec, max_batch=4, max_batch_frames=4 * 97)
    batcher.start()
    try:
        assert any(codec.padded_length(len(w.frames)) == 97 for w in windows)
        chunked = np.concatenate([await batcher.decode(window) for window in windows])
        too_long = DecodeWindow(0, frames[:97], 60 * SPF, 97 * SPF, 37)
        with pytest.raises(ValueError, match="longer than the 35-frame span"):
            await batcher.decode(too_long)
    finally:
        await batcher.close()
        codec.prepare((), max_batch=4)
    np.testing.assert_allclose(chunked, vllm_omni_whole(codec, frames), atol=TOLERANCE)


def test_without_spans_every_window_is_decoded_whole(model: Path, codec: Qwen3Codec) -> None:
    """`spans=False` (the baseline `bench/omni_codec.py` times spans against): chunk ends change nothing, the
    whole window's audio comes back, equal to the spanned codec's whole decode with the same weights."""
    whole = Qwen3Codec(model, device="cpu", random_weights=True, spans=False)
    whole.load()
    whole._model.load_state_dict(codec._model.state_dict())
    whole._model.precompute_snake_caches()
    frames = random_frames(97, 5)[None]
    assert whole.tail_frames is None and whole.span(97) == 97
    np.testing.assert_allclose(whole.decode(frames, [97]), codec.decode(frames), atol=TOLERANCE)
