"""Paced chunks for the omni engine's Qwen3-TTS pipeline: where vllm-omni's talker hands its codec frames to
the code2wav stage, each stream's chunks are cut by that stream's measured pace and the pipeline's load,
instead of by a fixed table.

This runs inside vllm-omni's talker stage process. The engine's deploy YAML (`paced_deploy`) names
`talker2code2wav_paced` as stage 0's `custom_process_next_stage_input_func` and puts the pacing parameters
in the codec connector's `extra` under `voicewire_pacing`. vllm-omni calls the function once per talker
step per request. It decides, then hands the step to vllm-omni's own Qwen3-TTS processor
(`omni_compat.qwen3_tts_chunk_processor`), which appends the step's frame and, when told to, cuts the
pending frames into a chunk with its usual left context and reference handling: the chunks code2wav
decodes are vllm-omni's own, only their boundaries are ours.

The model (`Pacer`). A player starts at the stream's first byte. A chunk cut now reaches the player about
one `lead` later: code2wav's decode of it and its turn among every stream's chunks (code2wav takes at most
one chunk of a request per step, and its step grows with the streams it serves). So the lead is
`lead_s + lead_per_stream_s * streams`, the streams being those the talker is running now or, if more, the
units the engine had in flight when it sent the request (`STREAMS_KEY` in its `additional_information`:
requests that arrive together reach the talker's steps one after another, so the first of a burst would
otherwise be paced for a load it is about to share). Then:

- the first chunk is cut as soon as it holds a lead of audio (one 80 ms frame at low load, the first
  chunk vllm-omni ships; more under load, since a smaller first chunk would run out before the next
  arrives), or the request's `initial_codec_chunk_frames` when it asks for one;
- a later chunk is cut at the last talker step that still lets it arrive before the audio already cut has
  played (the audio ahead of the player, less one more step of this stream's measured pace, is within a
  lead), once it holds a lead of audio; at once, whatever it holds, if a step later the audio cut would
  have played out;
- always at `codec_chunk_frames` (the decoder's window) and at the request's end.

Measured delivery (`DeliveryBoard`). Once a stream's chunks reach the engine in the server process, the
model's guesses give way to what was measured: the engine reports, per request, the audio delivered and when
the player that started at its first chunk runs dry, through a small file both processes map (one slot per
request in flight; `BOARD_KEY` in the request's `additional_information` names its slot). The pacer then
reads the player's clock instead of assuming it started a lead after the first cut, and each chunk's time
from its cut to its delivery (the pipeline's latency for this stream, held at its highest and let down
slowly) takes the model's lead's place where it is longer; the model's lead stays as the margin. So a
pipeline slower than the model (code2wav's queue under a burst, a stall of the server's own loop) makes the
next chunks cut earlier, on the stream it slows. Without a board (the talker stage on another host) or
before a stream's first delivery, the model alone decides.

So chunks are as large as each stream's lead allows: few code2wav decodes per second of audio (each one
re-reads `codec_left_context_frames` of context), which is what keeps code2wav's turn short under load,
while a stream that slows down (its steps longer) gets its chunks cut earlier.

The boundaries reach vllm-omni's processor through its own chunk-ramp mechanism: before each call the
processor's ramp is set to a table whose first entries sum to the frames this request has had cut and
whose next entry is the chunk wanted now (the pending frames plus this step's, to cut; the decoder's
window, to hold). Its `ramp_chunk_count` says how many chunks it has cut, so the table always lines up.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from voicewire.adapters import omni_compat

FIRST_CHUNK_KEY: Final = "initial_codec_chunk_frames"
"""The `additional_information` key of the frames a request asks its first chunk to hold (vllm-omni's)."""

PROCESSOR: Final = f"{__name__}.talker2code2wav_paced"
"""What the deploy YAML names as the talker stage's processor."""

EXTRA_KEY: Final = "voicewire_pacing"
"""The codec connector's `extra` key that holds `PaceParams` (as a mapping)."""

STREAMS_KEY: Final = "voicewire_streams"
"""The `additional_information` key of a request's load hint: the units the engine had in flight when it
sent the request, this one included."""

BOARD_KEY: Final = "voicewire_board"
"""The `additional_information` key of a request's `DeliveryBoard` ticket (its slot and tag in one number)."""

LATENCY_FALL: Final = 0.1
"""How fast a stream's measured latency comes down to a lower measurement (a higher one counts at once)."""

IDLE_S: Final = 1.0
"""A stream with no talker step for this long no longer counts toward the load."""

FORGET_S: Final = 60.0
"""A stream with no talker step for this long is forgotten (an aborted request gets no last call; a done
one may get its last step twice). Until then its frames cut are kept: a stream paused longer than `IDLE_S`,
or a done one whose last step comes again, must resume where its chunks ended, or a chunk would repeat
frames already sent."""

STEP_WEIGHT: Final = 0.2
"""Weight of the latest step in a stream's pace (an exponential moving average of its step intervals)."""

LEAD_S: Final = 0.055
LEAD_PER_STREAM_S: Final = 0.0015
"""The default lead: 55 ms plus 1.5 ms per stream the talker runs (71 ms at 16 streams, within one 80 ms
frame; 151 ms at 64, two frames). Fitted to the H200 record of the fixed ramp (docs/benchmarks.md): one-frame
chunks played without a stall at 16 streams and stalled by about 70 ms each at 64."""


@dataclass(frozen=True, slots=True)
class PaceParams:
    """The pacing model's parameters (module doc). `frame_s`: audio per codec frame; `steady`: the largest
    chunk, in frames (the connector's `codec_chunk_frames`); `lead_s` + `lead_per_stream_s` x streams: the
    time from cutting a chunk to its audio at the player; `board`, `board_slots`: the engine's
    `DeliveryBoard` file and its slots, or None."""

    frame_s: float
    steady: int
    lead_s: float = LEAD_S
    lead_per_stream_s: float = LEAD_PER_STREAM_S
    board: str | None = None
    board_slots: int = 0

    def __post_init__(self) -> None:
        if not (self.frame_s > 0 and self.steady >= 1 and self.lead_s >= 0 and self.lead_per_stream_s >= 0
                and (self.board is None or self.board_slots >= 1)):
            raise ValueError(f"omni pacing: bad parameters {self}")


@dataclass(slots=True)
class StreamPace:
    """One request's pacing state, in the talker's clock (`time.monotonic`)."""

    last_step: float
    step_s: float = 0.0
    """Its measured pace: the moving average of the time between its talker steps (0 until a second step)."""
    first_cut: float | None = None
    cut_frames: int = 0
    first_chunk: int | None = None
    """Frames the request asked its first chunk to hold (`initial_codec_chunk_frames`), or None."""
    streams_hint: int = 0
    """The units in flight when the request was sent (`STREAMS_KEY`), 0 when not told."""
    done: bool = False
    """Its last step was processed. Kept (until `FORGET_S`) with its frames cut: vllm-omni may process a
    request's last step twice (the request's end and its segment's), and a forgotten request would start
    over from frame 0 and send its audio again."""
    ticket: int | None = None
    """Its `DeliveryBoard` ticket (`BOARD_KEY`), or None."""
    cuts: dict[int, float] = field(default_factory=dict)
    """Chunks cut and not yet delivered: frames cut in all once each was cut -> when (with a ticket only)."""
    latency: float = 0.0
    """Its measured time from cutting a chunk to delivering it (0 until one was delivered)."""


@dataclass(slots=True)
class Pacer:
    """Decides, step by step, where each stream's chunks are cut (module doc). Pure: the time is passed in."""

    params: PaceParams
    board: DeliveryBoard | None = None
    """Where the engine reports each request's deliveries (module doc), or None: the model alone."""
    streams: dict[str, StreamPace] = field(default_factory=dict)
    _swept: float = float("-inf")
    _resting: int = 0
    """Streams done, or with no step for `IDLE_S`, at the last sweep or since (they do not count toward
    the load)."""

    def lead(self, streams_hint: int = 0) -> float:
        """Seconds from cutting a chunk to its audio at the player, at the current load (the streams the
        talker runs, or `streams_hint` if more)."""
        running = len(self.streams) - self._resting
        return self.params.lead_s + self.params.lead_per_stream_s * max(running, streams_hint)

    def frames_cut(self, request_id: str) -> int:
        """Frames of `request_id` already cut into chunks."""
        stream = self.streams.get(request_id)
        return 0 if stream is None else stream.cut_frames

    def step(self, request_id: str, now: float, pending: int, first_chunk: int | None = None,
             streams_hint: int | None = None, ticket: int | None = None) -> bool:
        """Record a talker step of `request_id` at `now` that leaves `pending` frames not yet cut, and say
        whether to cut them into a chunk now. On its first step: `first_chunk`, the frames its first chunk
        must hold when the request asks (`initial_codec_chunk_frames`, capped at the decoder's window),
        `streams_hint`, the units in flight when it was sent (`STREAMS_KEY`), and `ticket`, its slot on the
        board (`BOARD_KEY`)."""
        stream = self.streams.get(request_id)
        if stream is None:
            stream = self.streams[request_id] = StreamPace(last_step=now, first_chunk=first_chunk,
                                                           streams_hint=streams_hint or 0, ticket=ticket)
        else:
            interval = now - stream.last_step
            stream.step_s = interval if stream.step_s == 0 else (
                (1 - STEP_WEIGHT) * stream.step_s + STEP_WEIGHT * interval)
            stream.last_step = now
        self._sweep(now)
        p = self.params
        if pending <= 0:
            return False
        if pending >= p.steady:
            return True
        lead = self.lead(stream.streams_hint)
        if stream.first_cut is None:
            if stream.first_chunk is not None:
                return pending >= min(stream.first_chunk, p.steady)
            return pending >= max(1, math.ceil(lead / p.frame_s - 1e-9))
        # the player runs dry at `dry` unless a chunk cut now or later arrives first; a chunk cut a step from
        # now arrives `latency` after that: the slack is what that leaves (the model: the player started a
        # lead after the first cut, and a chunk takes a lead to reach it)
        dry, latency = stream.first_cut + lead + stream.cut_frames * p.frame_s, lead
        if stream.ticket is not None and self.board is not None:
            delivered = self._delivered(stream)
            if delivered is not None:
                dry, latency = delivered, max(lead, stream.latency)
        slack = dry - now - stream.step_s - latency
        if slack <= 0:
            return True
        return slack <= lead and pending * p.frame_s >= latency

    def _delivered(self, stream: StreamPace) -> float | None:
        """When `stream`'s player runs dry, counting the chunks cut but not yet delivered as on time, from
        the board (None before its first delivery); updates its measured latency on the way."""
        assert self.board is not None and stream.ticket is not None
        report = self.board.read(stream.ticket)
        if report is None:
            return None
        audio_s, at, dry_at = report
        frames = round(audio_s / self.params.frame_s)
        cut_at = stream.cuts.pop(frames, None)
        if cut_at is not None:  # the delivery of the chunk that ended at `frames`: how long it took
            measured = at - cut_at
            stream.latency = measured if measured > stream.latency else (
                stream.latency + LATENCY_FALL * (measured - stream.latency))
            for older in [n for n in stream.cuts if n < frames]:
                del stream.cuts[older]
        return dry_at + max(0, stream.cut_frames - frames) * self.params.frame_s

    def cut(self, request_id: str, now: float, frames: int) -> None:
        """Record that `frames` frames of `request_id` were cut into a chunk at `now`."""
        stream = self.streams.get(request_id)
        if stream is None or frames <= 0:
            return
        if stream.first_cut is None:
            stream.first_cut = now
        stream.cut_frames += frames
        if stream.ticket is not None:
            stream.cuts[stream.cut_frames] = now

    def finish(self, request_id: str) -> None:
        """Mark `request_id` done (its last step was processed): it no longer counts toward the load, and a
        repeat of its last step finds its frames cut (`StreamPace.done`)."""
        stream = self.streams.get(request_id)
        if stream is not None and not stream.done:
            stream.done = True
            self._resting += 1

    def _sweep(self, now: float) -> None:
        """Count the streams done or idle for `IDLE_S`, and forget those with no step for `FORGET_S` (at
        most ten times per `IDLE_S`: every call of a talker step would otherwise walk every stream)."""
        if now - self._swept < IDLE_S / 10:
            return
        self._swept = now
        for rid in [rid for rid, stream in self.streams.items() if now - stream.last_step > FORGET_S]:
            del self.streams[rid]
        self._resting = sum(1 for stream in self.streams.values() if stream.done or now - stream.last_step > IDLE_S)


_SEQUENCE: Final = struct.Struct("<Q")


class DeliveryBoard:
    """Each request's delivered audio, written by the engine in the server process and read by the pacer in
    vllm-omni's talker stage process (module doc), through a file both map: `slots` slots, one per request
    in flight. A request holds a ticket (`claim`): its slot, and a tag that tells it from the slot's earlier
    holders, in one number (slot = ticket % slots). A slot is (sequence, ticket, audio seconds delivered,
    when the latest piece was, when the player runs dry), times in `time.monotonic` (one clock for every
    process on the host); one writer, the engine's event loop, bumps the sequence before and after each
    write, so a reader that sees it odd or changed drops what it read (no lock across processes)."""

    SLOT: Final = struct.Struct("<QQddd")

    def __init__(self, path: str, slots: int, *, writer: bool) -> None:
        self.path, self.slots = path, slots
        size = slots * self.SLOT.size
        if writer:
            with open(path, "r+b") as f:
                f.truncate(size)
                self._map = mmap.mmap(f.fileno(), size)
        else:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        self._writer = writer
        self._free = list(range(slots - 1, -1, -1)) if writer else []
        self._rounds = itertools.count(1)

    @classmethod
    def create(cls, slots: int) -> DeliveryBoard:
        """A new board in a new file (in /dev/shm where there is one); `close` removes it."""
        shm = Path("/dev/shm")
        fd, path = tempfile.mkstemp(prefix="voicewire-omni-board-", dir=shm if shm.is_dir() else None)
        os.close(fd)
        return cls(path, slots, writer=True)

    @classmethod
    def open(cls, path: str, slots: int) -> DeliveryBoard | None:
        """The board at `path` to read, or None where there is none (the server on another host)."""
        try:
            return cls(path, slots, writer=False)
        except (OSError, ValueError):
            return None

    def claim(self) -> int | None:
        """A ticket for a new request, or None when every slot is taken (that request is paced by the
        model alone)."""
        if not self._free:
            return None
        slot = self._free.pop()
        ticket = next(self._rounds) * self.slots + slot
        self._write(slot, ticket, 0.0, 0.0, 0.0)
        return ticket

    def report(self, ticket: int, audio_s: float, at: float, dry_at: float) -> None:
        """`ticket`'s request has delivered `audio_s` seconds of audio, the latest at `at`; its player, which
        started at the first piece, runs dry at `dry_at`."""
        self._write(ticket % self.slots, ticket, audio_s, at, dry_at)

    def release(self, ticket: int) -> None:
        """`ticket`'s request has ended: its slot is free for another."""
        slot = ticket % self.slots
        self._write(slot, 0, 0.0, 0.0, 0.0)
        self._free.append(slot)

    def read(self, ticket: int) -> tuple[float, float, float] | None:
        """(audio seconds delivered, when the latest piece was, when the player runs dry) of `ticket`'s
        request, or None before its first piece, after it ended, or when a write was under way."""
        offset = (ticket % self.slots) * self.SLOT.size
        before = _SEQUENCE.unpack_from(self._map, offset)[0]
        _, held, audio_s, at, dry_at = self.SLOT.unpack_from(self._map, offset)
        if before % 2 or _SEQUENCE.unpack_from(self._map, offset)[0] != before or held != ticket or audio_s <= 0:
            return None
        return audio_s, at, dry_at

    def close(self) -> None:
        """Unmap the board; the writer (`create`) also removes its file."""
        self._map.close()
        if self._writer:
            Path(self.path).unlink(missing_ok=True)

    def _write(self, slot: int, ticket: int, audio_s: float, at: float, dry_at: float) -> None:
        offset = slot * self.SLOT.size
        sequence = _SEQUENCE.unpack_from(self._map, offset)[0]
        _SEQUENCE.pack_into(self._map, offset, sequence + 1)
        self.SLOT.pack_into(self._map, offset, sequence + 1, ticket, audio_s, at, dry_at)
        _SEQUENCE.pack_into(self._map, offset, sequence + 2)


def ramp_for(chunks_cut: int, frames_cut: int, chunk: int) -> list[int]:
    """A chunk-ramp table for vllm-omni's processor whose first `chunks_cut` entries sum to `frames_cut`
    and whose next entry is `chunk` (every entry at least 1)."""
    if chunks_cut <= 0:
        return [max(1, chunk)]
    return [max(1, frames_cut - (chunks_cut - 1)), *[1] * (chunks_cut - 1), max(1, chunk)]


def talker2code2wav_paced(transfer_manager: Any, multimodal_output: Any, request: Any,
                          is_finished: bool = False) -> Any:
    """vllm-omni's talker-to-code2wav step for Qwen3-TTS, with chunk boundaries from the `Pacer` (module
    doc); the same signature and result as vllm-omni's `talker2code2wav_async_chunk`, which does the work."""
    processor = omni_compat.qwen3_tts_chunk_processor()  # imported on the first call, before the clock is read
    pacer: Pacer | None = getattr(transfer_manager, "_voicewire_pacer", None)
    if pacer is None:
        params = pace_params(omni_compat.connector_extra(transfer_manager))
        board = None if params.board is None else DeliveryBoard.open(params.board, params.board_slots)
        pacer = transfer_manager._voicewire_pacer = Pacer(params, board)
    request_id, finished = omni_compat.chunk_request_state(request, is_finished)
    held = omni_compat.frames_held(transfer_manager, request_id)
    cut = pacer.frames_cut(request_id)
    now = time.monotonic()
    pending = held + 1 - cut  # with this step's frame, if it brings one
    if request_id in pacer.streams:  # what a request asks is read on its first step only
        cut_now = pacer.step(request_id, now, pending)
    else:
        cut_now = pacer.step(request_id, now, pending, omni_compat.request_number(request, FIRST_CHUNK_KEY),
                             omni_compat.request_number(request, STREAMS_KEY),
                             omni_compat.request_number(request, BOARD_KEY))
    wanted = pending if cut_now else pacer.params.steady
    omni_compat.set_chunk_ramp(transfer_manager, ramp_for(omni_compat.chunks_cut(transfer_manager, request_id),
                                                          cut, wanted))
    payload = processor(transfer_manager, multimodal_output, request, is_finished)
    if finished:
        pacer.finish(request_id)
    elif payload is not None:
        pacer.cut(request_id, now, omni_compat.frames_held(transfer_manager, request_id) - cut)
    return payload


def pace_params(extra: dict[str, Any]) -> PaceParams:
    """The `PaceParams` a codec connector's `extra` carries (`EXTRA_KEY`), its steady chunk from
    `codec_chunk_frames` (vllm-omni's default 25). Raises ValueError when they are missing or invalid."""
    given = extra.get(EXTRA_KEY)
    if not isinstance(given, dict) or "frame_s" not in given:
        raise ValueError(f"omni pacing: the codec connector's extra has no {EXTRA_KEY} with frame_s")
    board = given.get("board")
    return PaceParams(frame_s=float(given["frame_s"]), steady=int(extra.get("codec_chunk_frames", 25)),
                      lead_s=float(given.get("lead_s", LEAD_S)),
                      lead_per_stream_s=float(given.get("lead_per_stream_s", LEAD_PER_STREAM_S)),
                      board=None if board is None else str(board), board_slots=int(given.get("board_slots", 0)))
