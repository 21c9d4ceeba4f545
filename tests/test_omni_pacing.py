"""The pacing model of the omni engine's chunks (`adapters/omni_pacing.py`), on simulated talker timelines.

The simulation is the model the pacer is built on (its module doc): every stream's talker step brings one
80 ms frame; a chunk cut at time t reaches the player no sooner than `latency` later and no sooner than
`cadence` after the stream's previous chunk (code2wav takes one chunk of a request per step); the player
starts at the first byte. The pacer's end-to-end use in vllm-omni's talker stage, with the seams checked
against one whole decode: tests/test_omni_engine.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from voicewire.adapters.omni_pacing import FORGET_S, IDLE_S, DeliveryBoard, PaceParams, Pacer, ramp_for

FRAME_S = 0.08
STEADY = 25


@dataclass
class Played:
    chunks: list[int]
    first_audio_s: float
    """From the stream's first step to its first audio at the player."""
    stall_s: float


def play(pacer: Pacer, streams: int, frames: int, step_s: float, latency: float | Callable[[float], float],
         cadence: float, slow_from: int | None = None, slow_step_s: float = 0.0,
         board: DeliveryBoard | None = None) -> list[Played]:
    """Run `streams` streams of `frames` frames each in lockstep through `pacer` (a talker step every
    `step_s`, `slow_step_s` from step `slow_from` on); what each player heard. `latency`: seconds from a
    cut to its delivery, or a function of the cut's time. With `board` (the pacer's, as the engine writes
    it) each delivery is reported there as the engine does, before the stream's next step."""
    delay = latency if callable(latency) else (lambda _at: latency)
    chunks: list[list[tuple[float, int, float]]] = [[] for _ in range(streams)]  # (cut, frames, delivered)
    reported, dry_at = [0] * streams, [0.0] * streams
    tickets = [None if board is None else board.claim() for _ in range(streams)]
    held = [0] * streams
    now = 0.0
    for step in range(frames):
        now += slow_step_s if slow_from is not None and step >= slow_from else step_s
        for s in range(streams):
            rid, ticket = f"s{s}", tickets[s]
            if board is not None and ticket is not None:
                while reported[s] < len(chunks[s]) and chunks[s][reported[s]][2] <= now:
                    _, n, at = chunks[s][reported[s]]
                    reported[s] += 1
                    dry_at[s] = max(dry_at[s], at) + n * FRAME_S
                    board.report(ticket, sum(c[1] for c in chunks[s][:reported[s]]) * FRAME_S, at, dry_at[s])
            pending = held[s] + 1 - pacer.frames_cut(rid)
            held[s] += 1
            last = step == frames - 1
            if pacer.step(rid, now, pending, streams_hint=streams, ticket=ticket) or last:
                pacer.cut(rid, now, pending)
                arrival = now + delay(now)
                chunks[s].append((now, pending, max(arrival, chunks[s][-1][2] + cadence) if chunks[s] else arrival))
            if last:
                pacer.finish(rid)
    played = []
    for stream in chunks:
        clock, stall = stream[0][2], 0.0
        for _, n, arrival in stream:
            if arrival > clock:
                stall += arrival - clock
                clock = arrival
            clock += n * FRAME_S
        played.append(Played([n for _, n, _ in stream], stream[0][2] - step_s, stall))
    return played


def pacer(lead_s: float = 0.055, per_stream_s: float = 0.0015) -> Pacer:
    return Pacer(PaceParams(frame_s=FRAME_S, steady=STEADY, lead_s=lead_s, lead_per_stream_s=per_stream_s))


@pytest.mark.parametrize(("streams", "step_s"), [(1, 0.012), (4, 0.015), (16, 0.025), (64, 0.035), (64, 0.06)])
def test_no_stream_stalls_when_the_lead_covers_the_pipelines_latency(streams: int, step_s: float) -> None:
    p = pacer()
    lead = p.params.lead_s + p.params.lead_per_stream_s * streams
    for played in play(p, streams, 150, step_s, latency=lead / 2, cadence=lead):
        assert played.stall_s == 0, played
        assert sum(played.chunks) == 150 and max(played.chunks) <= STEADY
        assert all(n * FRAME_S >= lead for n in played.chunks[:-1]), played.chunks  # each covers the cadence


def test_the_first_chunk_is_one_frame_at_low_load_and_covers_the_lead_under_load() -> None:
    assert [played.chunks[0] for played in play(pacer(), 1, 40, 0.012, 0.03, 0.05)] == [1]
    assert {played.chunks[0] for played in play(pacer(), 64, 40, 0.035, 0.07, 0.15)} == {2}  # 151 ms: 2 frames
    first_audio = play(pacer(), 64, 40, 0.035, 0.07, 0.15)[0].first_audio_s
    assert first_audio == pytest.approx(0.035 + 0.07)  # one talker step more than a one-frame first chunk


def test_chunks_grow_to_the_decoders_window_while_the_talker_is_ahead() -> None:
    """Fewer code2wav decodes than the fixed ramp (1,1,1,1,2,3,4,6,9,14,21, then 25s): 150 frames at 1
    stream and a talker at 8x real time."""
    chunks = play(pacer(), 1, 150, 0.01, 0.03, 0.05)[0].chunks
    assert chunks[0] == 1 and STEADY in chunks and len(chunks) < 16, chunks


def test_a_stream_that_slows_gets_its_chunks_cut_earlier_and_does_not_stall() -> None:
    steady = play(pacer(), 1, 150, 0.01, 0.03, 0.05)[0]
    slowed = play(pacer(), 1, 150, 0.01, 0.03, 0.05, slow_from=20, slow_step_s=0.07)[0]
    assert slowed.stall_s == 0
    assert min(steady.chunks[3:-1]) == STEADY  # ahead: every chunk the decoder's window
    assert min(slowed.chunks[3:-1]) < STEADY  # slowed: cut before the window fills, so none arrives late


def test_a_talker_slower_than_real_time_stalls_less_than_with_one_frame_then_the_window() -> None:
    """Past real time nothing avoids stalls; paced chunks cut at once rather than wait for a full window."""
    paced = play(pacer(), 1, 100, 0.1, 0.03, 0.05)[0]
    assert paced.stall_s < 0.02 * 100 + 0.1 and max(paced.chunks) <= 2


@pytest.fixture
def board() -> Iterator[DeliveryBoard]:
    written = DeliveryBoard.create(64 + 16)
    yield written
    written.close()


def paced_by(written: DeliveryBoard) -> Pacer:
    """A pacer that reads `written` as the talker stage's does: its own mapping of the file."""
    p = pacer()
    p.board = DeliveryBoard.open(written.path, written.slots)
    return p


def rising(at: float) -> float:
    """A pipeline whose latency climbs from 60 to 300 ms over its first second (code2wav's queue growing
    under a burst of streams), then stays there."""
    return 0.06 + 0.24 * min(at, 1.0)


@pytest.mark.parametrize(("streams", "step_s"), [(16, 0.025), (64, 0.035)])
def test_measured_deliveries_keep_streams_whose_pipeline_slows_from_stalling(streams: int, step_s: float,
                                                                            board: DeliveryBoard) -> None:
    """The model's lead (79 ms at 16 streams, 151 at 64) cannot know the pipeline is slowing: every stream
    stalls. With the engine's reports the pacer reads the player's clock and each chunk's latency, and cuts
    the next chunks earlier: no stream stalls, and the chunks still grow to the decoder's window."""
    model = play(pacer(), streams, 150, step_s, rising, cadence=0.0)
    assert all(played.stall_s > 0 for played in model)
    measured = play(paced_by(board), streams, 150, step_s, rising, cadence=0.0, board=board)
    assert all(played.stall_s == 0 for played in measured), [p.stall_s for p in measured]
    assert all(sum(played.chunks) == 150 and STEADY in played.chunks for played in measured)


def test_measured_deliveries_change_nothing_where_the_model_holds(board: DeliveryBoard) -> None:
    """A steady pipeline: the player's clock as measured is the one the model assumed, give or take the
    latency, so the same chunks are cut."""
    model = play(pacer(), 16, 150, 0.025, 0.2, cadence=0.0)
    measured = play(paced_by(board), 16, 150, 0.025, 0.2, cadence=0.0, board=board)
    assert [p.chunks for p in measured] == [p.chunks for p in model]
    assert all(p.stall_s == 0 for p in measured)


def test_the_board_carries_each_tickets_deliveries_and_nothing_stale(tmp_path: Path) -> None:
    board = DeliveryBoard.create(2)
    reader = DeliveryBoard.open(board.path, 2)
    assert reader is not None
    first, second = board.claim(), board.claim()
    assert first is not None and second is not None and board.claim() is None  # every slot taken
    assert reader.read(first) is None  # nothing delivered yet
    board.report(first, 0.08, 10.0, 10.08)
    assert reader.read(first) == (0.08, 10.0, 10.08) and reader.read(second) is None
    board.release(first)
    assert reader.read(first) is None
    third = board.claim()
    assert third is not None and third != first and third % 2 == first % 2  # its slot, another tag
    board.report(third, 0.16, 11.0, 11.16)
    assert reader.read(first) is None and reader.read(third) == (0.16, 11.0, 11.16)
    offset = (third % 2) * DeliveryBoard.SLOT.size  # a write under way: its sequence is odd
    board._map[offset] += 1
    assert reader.read(third) is None
    reader.close()
    board.close()
    assert not Path(board.path).exists()
    assert DeliveryBoard.open(str(tmp_path / "missing"), 2) is None  # the server on another host


def test_a_requested_first_chunk_is_honoured() -> None:
    p = pacer()
    assert not p.step("a", 0.0, 1, first_chunk=3) and not p.step("a", 0.01, 2)
    assert p.step("a", 0.02, 3)


def test_idle_and_done_streams_stop_counting_toward_the_load_but_keep_their_frames_cut() -> None:
    p = pacer()
    p.step("paused", 0.0, 1)
    p.cut("paused", 0.0, 1)
    p.step("live", 0.0, 1)
    assert p.lead() == pytest.approx(0.055 + 2 * 0.0015)
    p.step("live", IDLE_S + 0.5, 2)
    assert p.lead() == pytest.approx(0.055 + 0.0015)  # "paused" no longer counts toward the load
    assert p.frames_cut("paused") == 1  # but its chunks so far are kept: no frame is cut twice
    p.step("live", FORGET_S + 1.0, 3)
    assert set(p.streams) == {"live"}  # gone after FORGET_S (an aborted request gets no last call)
    p.finish("live")
    assert p.lead() == pytest.approx(0.055) and "live" in p.streams  # done: no load, but remembered
    p.step("next", 2 * FORGET_S + 2.0, 1)
    assert set(p.streams) == {"next"}  # until FORGET_S after its last step


def test_the_ramp_table_lines_up_with_what_vllm_omni_has_cut() -> None:
    for chunks_cut, frames_cut, chunk in ((0, 0, 1), (1, 1, 3), (3, 9, 25), (5, 40, 2)):
        table = ramp_for(chunks_cut, frames_cut, chunk)
        assert len(table) == chunks_cut + 1 and min(table) >= 1
        assert sum(table[:chunks_cut]) == frames_cut and table[-1] == chunk


def test_vllm_omnis_processor_cuts_where_the_pacer_says_and_a_repeated_last_step_sends_nothing_again() -> None:
    """The pacing processor around vllm-omni's own Qwen3-TTS processor (0.30, as CI installs it), fed 40
    frames as fast as a talker far ahead of real time: one frame first, then the decoder's window, then the
    rest; vllm-omni may process a request's last step twice, and the second time no frame goes out again
    (a pacer that forgot the request at its end re-sent nearly all of its audio: 22.96 s streams of 11.92
    on the H200, docs/benchmarks.md). The transfer manager is a plain stand-in holding what vllm-omni's
    processor reads and writes."""
    pytest.importorskip("vllm_omni", reason="vllm-omni is not installed (extra omni-cpu)")
    import torch
    from voicewire.adapters.omni_pacing import EXTRA_KEY, talker2code2wav_paced

    manager = SimpleNamespace(
        connector=SimpleNamespace(config={"extra": {"codec_chunk_frames": STEADY, "codec_left_context_frames": 72,
                                                    EXTRA_KEY: {"frame_s": FRAME_S}}}),
        code_prompt_token_ids=defaultdict(list), put_req_chunk=defaultdict(int), ramp_chunk_count=defaultdict(int),
        request_payload={}, scheduler_max_num_seqs=4)
    request = SimpleNamespace(external_req_id="unit-1", additional_information=None, done=False)
    request.is_finished = lambda: request.done

    def new_frames(payload: Any) -> int:
        if payload is None:
            return 0
        frames = payload.codes.audio.numel() // 16
        manager.put_req_chunk["unit-1"] += 1  # what vllm-omni's connector does once a chunk is sent
        manager.ramp_chunk_count["unit-1"] += 1
        return frames - int(payload.meta.left_context_size or 0)

    chunks = []
    for i in range(40):
        request.done = i == 39
        output = {"codes": {"audio": torch.full((1, 16), i + 1, dtype=torch.long)},
                  "meta": {"codec_frame_valid": torch.tensor([True])}}
        if n := new_frames(talker2code2wav_paced(manager, output, request, is_finished=request.done)):
            chunks.append(n)
    assert chunks == [1, STEADY, 40 - 1 - STEADY]
    assert new_frames(talker2code2wav_paced(manager, None, request, is_finished=True)) == 0
