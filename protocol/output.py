"""The output side of a session, sans I/O: which units synthesize now, and what goes out next, in order.

`OutputMachine` is fed committed units (`commit`), utterance ends (`finish_utterance`), control events
(`emit`), each started unit's rendered pieces and outcome (`piece`, `unit_finished`) and cancels
(`cancel_utterance`, `close`). It answers three questions: which units to start synthesizing now
(`take_due`, each with its playback deadline), what to send next (`next_output`: one event or one audio
frame at a time), and which units ended how (`take_ended`). It never touches a socket, a task or a clock of
its own: time comes in as arguments. The WebSocket writer and REST speech both run on it; the runtime keeps
only the sockets, the synthesis tasks and the timeouts.

Guarantees (tests/test_output_machine.py checks them under any interleaving of inputs):
- Units go out strictly in commit order, each as `audio.start`, its audio (`audio.words` right before the
  audio they belong to, with binary frames), then `audio.done`; `session.done` follows an utterance's last
  unit. Control events go before unit frames, except between a unit's `audio.words` and its audio.
- Every `audio.start` gets exactly one `audio.done`: when the unit ends (`error` true if it failed), when
  its utterance is cancelled, and on `close(announce=True)`. Only `close(announce=False)` (the session is
  ending, nothing more is sent) leaves a started unit without one.
- At most `max_in_flight` units are started and not yet ended.
- Every committed unit ends exactly once (`take_ended`): `ok`, `failed`, or `cancelled`. A unit ends when
  its last frame is handed out, or when it is dropped; `total_bytes` and `audio_ms` of its `audio.done`
  count exactly the audio handed out for it.

Memory: the committed units not yet ended (the session state machine bounds that backlog with
`max_utterance_chars`), the rendered pieces of at most `max_in_flight` units (each at most one unit's audio,
dropped at once when the unit ends), the control events not yet taken (the runtime bounds those with
`max_pending_events`), and a few numbers per utterance in the queue.
"""

from __future__ import annotations

import base64
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from voicewire.protocol.messages import (
    AudioCancelled,
    AudioChunk,
    AudioDone,
    AudioStart,
    AudioWords,
    ErrorEvent,
    ServerEvent,
    SessionDone,
    Timings,
)
from voicewire.protocol.render import RenderedPiece, place_words
from voicewire.protocol.session import Unit

Outcome = Literal["ok", "failed", "cancelled"]

Frame = ServerEvent | RenderedPiece
"""What `next_output` hands out: an event (a JSON text frame) or a unit's audio as one binary frame (its
`data`; only for `audio_frames="binary"`: JSON framing wraps audio in `audio.chunk` events)."""


@dataclass(slots=True, eq=False)
class UnitOutput:
    """One committed unit, from commit until it ends. The runtime reads it; only `OutputMachine` writes it."""

    unit: Unit
    estimate_ms: float
    """Expected audio duration, for the playback deadlines of the units behind it."""
    deadline_ms: float = 0.0
    """When the listener runs dry without this unit (set when it is due to start; see `take_due`)."""
    started: bool = False
    outcome: Outcome | None = None
    """How it ended; None until then."""
    failure: tuple[str, str] | None = None
    """(error code, reason) when synthesis failed."""
    engine_s: float = 0.0
    first_audio_ms: float | None = None
    """Set when this unit carried its utterance's first audio: ms from the utterance's first commit."""
    bytes_sent: int = 0
    samples_sent: int = 0
    _pieces: deque[RenderedPiece] = field(default_factory=deque)
    _finished: bool = False
    _announced: bool = False
    _words_out: bool = False
    """The first piece's `audio.words` went out; its audio goes next, before any control event."""
    _chunk_id: int = 0
    _offset_ms: float = 0.0
    _unit_words: list[tuple[int, int, float, float]] = field(default_factory=list)
    """Words handed out so far on the unit timeline (JSON framing's trailing timestamps chunk)."""

    @property
    def sent_ms(self) -> float:
        """Duration of the audio handed out for this unit."""
        return self.samples_sent * 1000.0 / self.unit.config.sample_rate


@dataclass(frozen=True, slots=True)
class _UtteranceEnd:
    utterance_index: int
    total_sentences: int


@dataclass(slots=True)
class _Utterance:
    committed_first_ms: float | None = None
    first_audio_ms: float | None = None
    audio_ms: float = 0.0
    engine_s: float = 0.0


class OutputMachine:
    """Ordered output of one session's (or one REST request's) units; see the module doc for the contract.

    Calls after `close` are safe: a unit committed then ends `cancelled` at once, cancels and utterance ends
    do nothing, pieces and outcomes of dropped units are ignored, and `next_output` hands out only control
    events.
    """

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self.closed = False
        self._queue: deque[UnitOutput | _UtteranceEnd] = deque()
        self._control: deque[ServerEvent] = deque()
        self._utterances: dict[int, _Utterance] = {}
        self._due: list[UnitOutput] = []
        self._ended: list[UnitOutput] = []
        self._dry_at_ms: float | None = None
        """When the listener will have played all audio handed out so far."""

    # -- inputs ---------------------------------------------------------------------------------

    def commit(self, unit: Unit, estimate_ms: float) -> UnitOutput:
        """Queue `unit` behind everything committed before it; it becomes due when the cap allows."""
        out = UnitOutput(unit, estimate_ms)
        if self.closed:
            self._end(out, "cancelled")
            return out
        stats = self._utterances.setdefault(unit.utterance_index, _Utterance())
        if stats.committed_first_ms is None:
            stats.committed_first_ms = unit.committed_ms
        self._queue.append(out)
        self._pump()
        return out

    def finish_utterance(self, utterance_index: int, total_sentences: int) -> None:
        """No more units come for this utterance: `session.done` goes out after its last one."""
        if self.closed:
            return
        self._utterances.setdefault(utterance_index, _Utterance())
        self._queue.append(_UtteranceEnd(utterance_index, total_sentences))

    def emit(self, event: ServerEvent) -> None:
        """Queue a control event; it goes out before any unit frame not yet handed out."""
        self._control.append(event)

    def piece(self, out: UnitOutput, piece: RenderedPiece) -> None:
        """The next rendered piece of a started unit (ignored once the unit ended)."""
        if out.outcome is None:
            out._pieces.append(piece)

    def unit_finished(self, out: UnitOutput, engine_s: float, failure: tuple[str, str] | None = None) -> None:
        """A started unit's synthesis is over: it rendered all its pieces, or failed with (code, reason)
        after those it rendered. Ignored once the unit ended (it was dropped)."""
        if out.outcome is None:
            out._finished = True
            out.engine_s = engine_s
            out.failure = failure

    def cancel_utterance(self, utterance_index: int, context_id: str | None) -> None:
        """Drop the utterance's units and its end; started ones get `audio.done` (error), then
        `audio.cancelled` with the audio handed out for the utterance."""
        if self.closed:
            return
        stats = self._utterances.pop(utterance_index, None)
        self._drop(lambda owner: owner == utterance_index, announce=True)
        self._control.append(AudioCancelled(utterance_index=utterance_index,
                                            audio_ms=_ms(stats.audio_ms if stats else 0.0), context_id=context_id))
        self._pump()

    def close(self, *, announce: bool = True) -> None:
        """Drop every unit and utterance end; with `announce`, started units get their `audio.done`
        (error). Control events already queued stay (`discard_events` drops them)."""
        self.closed = True
        self._drop(lambda _owner: True, announce=announce)
        self._utterances.clear()

    def discard_events(self) -> None:
        """Forget the control events not yet handed out (the client is gone or stalled)."""
        self._control.clear()

    # -- outputs --------------------------------------------------------------------------------

    def take_due(self) -> list[UnitOutput]:
        """Units to start synthesizing now, earliest first, each with its `deadline_ms`. The caller must
        start each one and report its pieces (`piece`) and end (`unit_finished`)."""
        due = self._due
        if due:
            self._due = []
        return due

    def take_ended(self) -> list[UnitOutput]:
        """Units that ended since the last call, each once, with its `outcome`. A `cancelled` one may
        still be synthesizing: the caller stops that work."""
        ended = self._ended
        if ended:
            self._ended = []
        return ended

    @property
    def pending_events(self) -> int:
        """Control events (and the closing events of ended units) not yet handed out."""
        return len(self._control)

    @property
    def busy(self) -> bool:
        """Something is still to be handed out (or to be synthesized and then handed out)."""
        return bool(self._queue or self._control)

    def next_output(self, now_ms: float) -> Frame | None:
        """The next frame to send, or None when nothing can go out until more pieces or a unit's end
        arrive. A frame counts as sent when handed out: `now_ms` is the time it goes to the wire (it
        moves the playback clock behind the deadlines, and times an utterance's first audio)."""
        queue = self._queue
        if self._control:
            head = queue[0] if queue else None
            if not (isinstance(head, UnitOutput) and head._words_out):
                return self._control.popleft()
        while queue:
            head = queue[0]
            if isinstance(head, _UtteranceEnd):
                queue.popleft()
                return self._utterance_done(head)
            unit = head.unit
            config = unit.config
            if not head._announced:
                head._announced = True
                head._offset_ms = self._utterances[unit.utterance_index].audio_ms
                return AudioStart(
                    utterance_index=unit.utterance_index, sentence_index=unit.sentence_index,
                    sentence_text=unit.text, format=config.response_format,
                    word_timestamps=config.word_timestamps, sample_rate=config.sample_rate, channels=1,
                    context_id=unit.context_id)
            pieces = head._pieces
            if pieces:
                piece = pieces[0]
                if config.word_timestamps:
                    if config.audio_frames == "binary":
                        if piece.words and not head._words_out:
                            if piece.data:
                                head._words_out = True
                            else:
                                pieces.popleft()
                            return AudioWords(utterance_index=unit.utterance_index,
                                              sentence_index=unit.sentence_index,
                                              words=place_words(piece.words, unit.text, unit.char_start,
                                                                head._offset_ms))
                        head._words_out = False
                    else:
                        head._unit_words.extend(piece.words)
                pieces.popleft()
                if piece.data:
                    return self._audio(head, piece, now_ms)
                continue
            if not head._finished:
                return None
            queue.popleft()
            self._unit_done(head)
            self._pump()
            return self._control.popleft()
        return None

    # -- internals ------------------------------------------------------------------------------

    def _audio(self, out: UnitOutput, piece: RenderedPiece, now_ms: float) -> Frame:
        unit = out.unit
        config = unit.config
        stats = self._utterances[unit.utterance_index]
        if stats.first_audio_ms is None and stats.committed_first_ms is not None:
            stats.first_audio_ms = out.first_audio_ms = now_ms - stats.committed_first_ms
        dry = self._dry_at_ms
        self._dry_at_ms = (now_ms if dry is None or dry < now_ms else dry) + piece.samples * 1000.0 / config.sample_rate
        start_ms = _ms(out.sent_ms)
        out.samples_sent += piece.samples
        out.bytes_sent += len(piece.data)
        end_ms = out.sent_ms
        stats.audio_ms = out._offset_ms + end_ms
        if config.audio_frames == "binary":
            return piece
        chunk = AudioChunk(
            utterance_index=unit.utterance_index, sentence_index=unit.sentence_index, chunk_id=out._chunk_id,
            chunk_start_ms=round(start_ms), chunk_end_ms=round(end_ms), sample_rate=config.sample_rate,
            channels=1, audio_b64=base64.b64encode(piece.data).decode(), timestamps=None)
        out._chunk_id += 1
        return chunk

    def _unit_done(self, out: UnitOutput) -> None:
        """The head unit's last frames (failure or trailing words, then `audio.done`) go to the control
        queue, which is empty here, so they leave before anything emitted later."""
        unit = out.unit
        config = unit.config
        self._utterances[unit.utterance_index].engine_s += out.engine_s
        if out.failure is not None:
            code, reason = out.failure
            partial = out.bytes_sent > 0
            self._control.append(ErrorEvent(
                message=f"Generation failed for utterance {unit.utterance_index}, sentence "
                        f"{unit.sentence_index}: {reason}",
                code=code, fatal=False, partial_audio=True if partial else None,
                action="discard" if partial else None, utterance_index=unit.utterance_index,
                sentence_index=unit.sentence_index))
        elif config.word_timestamps and config.audio_frames == "json":
            self._control.append(AudioChunk(
                utterance_index=unit.utterance_index, sentence_index=unit.sentence_index,
                chunk_id=out._chunk_id, chunk_start_ms=0, chunk_end_ms=round(out.sent_ms),
                sample_rate=config.sample_rate, channels=1, audio_b64="",
                timestamps=place_words(out._unit_words, unit.text, unit.char_start, 0.0)))
        self._control.append(self._audio_done(out, error=out.failure is not None))
        self._end(out, "failed" if out.failure is not None else "ok")

    def _utterance_done(self, end: _UtteranceEnd) -> SessionDone:
        stats = self._utterances.pop(end.utterance_index, None) or _Utterance()
        return SessionDone(
            utterance_index=end.utterance_index, total_sentences=end.total_sentences,
            audio_ms=_ms(stats.audio_ms),
            timings=Timings(
                first_audio_ms=None if stats.first_audio_ms is None else round(stats.first_audio_ms, 2),
                engine_ms=round(stats.engine_s * 1000.0, 2)))

    @staticmethod
    def _audio_done(out: UnitOutput, *, error: bool) -> AudioDone:
        return AudioDone(utterance_index=out.unit.utterance_index, sentence_index=out.unit.sentence_index,
                         total_bytes=out.bytes_sent, error=error, audio_ms=_ms(out.sent_ms))

    def _end(self, out: UnitOutput, outcome: Outcome) -> None:
        out.outcome = outcome
        out._pieces.clear()
        out._words_out = False
        self._ended.append(out)

    def _drop(self, drop: Callable[[int], bool], *, announce: bool) -> None:
        kept: deque[UnitOutput | _UtteranceEnd] = deque()
        for item in self._queue:
            if isinstance(item, _UtteranceEnd):
                if not drop(item.utterance_index):
                    kept.append(item)
                continue
            if not drop(item.unit.utterance_index):
                kept.append(item)
                continue
            if announce and item._announced:
                self._control.append(self._audio_done(item, error=True))
            self._end(item, "cancelled")
        self._queue = kept

    def _pump(self) -> None:
        """Make the earliest units due while fewer than the cap are in flight, each with its deadline:
        once the audio handed out and the expected rest of the units ahead of it have played (before any
        audio, counted from the first queued unit's commit), and never before its own commit, so a backlog
        cannot jump ahead of another session's first unit."""
        if self.closed:
            return
        in_flight = 0
        base: float | None = self._dry_at_ms
        ahead = 0.0
        for item in self._queue:
            if isinstance(item, _UtteranceEnd):
                continue
            if base is None:
                base = item.unit.committed_ms
            if not item.started:
                if in_flight >= self.max_in_flight:
                    return
                item.started = True
                item.deadline_ms = max(item.unit.committed_ms, base + ahead)
                self._due.append(item)
            in_flight += 1
            ahead += max(0.0, item.estimate_ms - item.sent_ms)


def _ms(value: float) -> float:
    return round(value, 2)
