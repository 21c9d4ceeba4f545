"""The sans-I/O output machine: unit order, in-flight cap, start/done pairing under any cancel, session.done,
audio_ms/total_bytes arithmetic, deadlines. No socket, no task, no clock: microseconds per case."""

from __future__ import annotations

import base64
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from voicewire.protocol.engine import SpeechParams
from voicewire.protocol.messages import (
    AudioCancelled,
    AudioChunk,
    AudioDone,
    AudioFrames,
    AudioStart,
    AudioWords,
    EffectiveConfig,
    ErrorEvent,
    SessionDone,
)
from voicewire.protocol.output import Frame, OutputMachine, UnitOutput
from voicewire.protocol.render import RenderedPiece
from voicewire.protocol.session import Unit

RATE = 24000


def config(audio_frames: AudioFrames = "binary", word_timestamps: bool = False) -> EffectiveConfig:
    return EffectiveConfig(
        model="hibari", voice="heart", language=None, instructions=None, speed=1.0, response_format="pcm",
        sample_rate=RATE, stream_audio=True, split_granularity="sentence", max_buffer_delay_ms=0,
        word_timestamps=word_timestamps, audio_frames=audio_frames, seed=None, max_new_tokens=None,
        initial_codec_chunk_frames=None, task_type="CustomVoice")


BINARY = config()
BINARY_WORDS = config("binary", word_timestamps=True)
JSON = config("json")
JSON_WORDS = config("json", word_timestamps=True)
PARAMS = SpeechParams()


def unit(utterance: int, sentence: int, *, cfg: EffectiveConfig = BINARY, committed_ms: float = 0.0,
         text: str = "Hello there.", char_start: int = 0) -> Unit:
    return Unit(utterance_index=utterance, sentence_index=sentence, text=text, char_start=char_start,
                char_end=char_start + len(text), config=cfg, params=PARAMS, context_id=None, committed_ms=committed_ms)


def piece(samples: int, words: list[tuple[int, int, float, float]] | None = None) -> RenderedPiece:
    return RenderedPiece(b"\x01\x00" * samples, samples, words or [])


def drain(m: OutputMachine, now_ms: float = 0.0) -> list[Frame]:
    frames: list[Frame] = []
    while (frame := m.next_output(now_ms)) is not None:
        frames.append(frame)
    return frames


def kinds(frames: list[Frame]) -> list[str]:
    return ["audio" if isinstance(f, RenderedPiece) else type(f).__struct_config__.tag for f in frames]  # type: ignore[misc]


def keys(outs: list[UnitOutput]) -> list[tuple[int, int]]:
    return [(o.unit.utterance_index, o.unit.sentence_index) for o in outs]


# -- examples -------------------------------------------------------------------------------------------


def test_a_unit_goes_out_as_start_audio_done_then_session_done_with_its_arithmetic() -> None:
    m = OutputMachine(2)
    a = m.commit(unit(0, 0), 1000.0)
    m.finish_utterance(0, 1)
    assert m.take_due() == [a] and a.deadline_ms == 0.0
    m.piece(a, piece(2400))
    m.piece(a, piece(1200))
    assert kinds(drain(m, 10.0)) == ["audio.start", "audio", "audio"]
    m.unit_finished(a, 0.25)
    frames = drain(m, 20.0)
    assert kinds(frames) == ["audio.done", "session.done"]
    done, session_done = frames
    assert isinstance(done, AudioDone) and isinstance(session_done, SessionDone)
    assert (done.total_bytes, done.audio_ms, done.error) == (7200, 150.0, False)
    assert session_done.audio_ms == 150.0 and session_done.total_sentences == 1
    assert session_done.timings.first_audio_ms == 10.0 and session_done.timings.engine_ms == 250.0
    assert m.take_ended() == [a] and a.outcome == "ok" and a.first_audio_ms == 10.0
    assert not m.busy


def test_units_go_out_in_commit_order_even_when_a_later_one_finishes_first() -> None:
    m = OutputMachine(2)
    a, b = m.commit(unit(0, 0), 500.0), m.commit(unit(0, 1), 500.0)
    assert m.take_due() == [a, b]
    m.piece(b, piece(100))
    m.unit_finished(b, 0.1)
    assert kinds(drain(m)) == ["audio.start"]  # a's start; nothing of b before a ends
    m.piece(a, piece(100))
    m.unit_finished(a, 0.1)
    frames = drain(m)
    assert kinds(frames) == ["audio", "audio.done", "audio.start", "audio", "audio.done"]
    starts = [f for f in frames if isinstance(f, AudioStart)]
    assert [s.sentence_index for s in starts] == [1]
    assert keys(m.take_ended()) == [(0, 0), (0, 1)]


def test_the_in_flight_cap_holds_later_units_until_the_head_ends() -> None:
    m = OutputMachine(2)
    outs = [m.commit(unit(0, n), 100.0) for n in range(4)]
    assert m.take_due() == outs[:2]
    m.unit_finished(outs[1], 0.0)
    drain(m)
    assert m.take_due() == []  # the second finishing does not free a slot: the head is still out
    m.unit_finished(outs[0], 0.0)
    m.next_output(0.0)  # the head's audio.done: it ended
    assert m.take_due() == [outs[2]]


def test_cancel_after_audio_start_closes_the_unit_with_the_audio_sent_then_audio_cancelled() -> None:
    m = OutputMachine(2)
    a, b = m.commit(unit(0, 0), 1000.0), m.commit(unit(0, 1), 1000.0)
    m.take_due()
    m.piece(a, piece(480))
    assert kinds(drain(m)) == ["audio.start", "audio"]
    m.piece(a, piece(480))  # rendered, never handed out
    m.cancel_utterance(0, "ctx")
    frames = drain(m)
    assert kinds(frames) == ["audio.done", "audio.cancelled"]
    done, cancelled = frames
    assert isinstance(done, AudioDone) and isinstance(cancelled, AudioCancelled)
    assert (done.sentence_index, done.total_bytes, done.audio_ms, done.error) == (0, 960, 20.0, True)
    assert (cancelled.audio_ms, cancelled.context_id) == (20.0, "ctx")
    assert m.take_ended() == [a, b] and {a.outcome, b.outcome} == {"cancelled"}
    m.piece(a, piece(480))  # late pieces and ends of dropped units are ignored
    m.unit_finished(b, 0.0)
    assert drain(m) == [] and not m.busy


def test_a_failed_unit_says_why_then_closes_with_error_and_the_next_unit_follows() -> None:
    m = OutputMachine(1)
    a, b = m.commit(unit(0, 0), 100.0), m.commit(unit(0, 1), 100.0)
    m.finish_utterance(0, 2)
    assert m.take_due() == [a]
    m.piece(a, piece(240))
    m.unit_finished(a, 0.5, ("unit_timeout", "timed out"))
    frames = drain(m)
    assert kinds(frames) == ["audio.start", "audio", "error", "audio.done", "audio.start"]
    error, done = frames[2], frames[3]
    assert isinstance(error, ErrorEvent) and isinstance(done, AudioDone)
    assert (error.code, error.fatal, error.partial_audio, error.action) == ("unit_timeout", False, True, "discard")
    assert (error.utterance_index, error.sentence_index) == (0, 0) and "timed out" in error.message
    assert done.error and done.total_bytes == 480
    assert m.take_ended() == [a] and a.outcome == "failed" and m.take_due() == [b]
    m.unit_finished(b, 0.0)
    frames = drain(m)
    assert kinds(frames) == ["audio.done", "session.done"]
    assert isinstance(frames[1], SessionDone) and frames[1].timings.engine_ms == 500.0


def started_with_words() -> OutputMachine:
    """A machine whose one unit has sent `audio.start` and holds a piece with a word (and audio)."""
    m = OutputMachine(2)
    a = m.commit(unit(0, 0, cfg=BINARY_WORDS, text="Hi you."), 100.0)
    m.take_due()
    m.piece(a, piece(240, [(0, 2, 0.0, 5.0)]))
    assert isinstance(m.next_output(0.0), AudioStart)
    return m


def test_control_events_go_first_but_never_between_words_and_their_audio() -> None:
    m = started_with_words()
    m.emit(ErrorEvent(message="first", code="x", fatal=False))
    assert isinstance(m.next_output(0.0), ErrorEvent)  # queued before the words: goes first
    words = m.next_output(0.0)
    assert isinstance(words, AudioWords) and [(w.word, w.start_ms, w.end_ms) for w in words.words] == [("Hi", 0, 5)]
    m.emit(ErrorEvent(message="later", code="y", fatal=False))
    assert kinds(drain(m)) == ["audio", "error"]  # y waits for the audio the words belong to


def test_words_cancelled_before_their_audio_leave_no_audio() -> None:
    m = started_with_words()
    assert isinstance(m.next_output(0.0), AudioWords)
    m.cancel_utterance(0, None)
    frames = drain(m)
    assert kinds(frames) == ["audio.done", "audio.cancelled"]
    assert isinstance(frames[0], AudioDone) and frames[0].total_bytes == 0


def test_json_framing_numbers_chunks_and_ends_with_the_units_words() -> None:
    m = OutputMachine(2)
    m.commit(unit(0, 0, cfg=JSON_WORDS, text="One two.", char_start=4), 100.0)
    (a,) = m.take_due()
    m.piece(a, piece(240, [(0, 3, 0.0, 4.0)]))
    m.piece(a, piece(480, [(4, 7, 5.0, 29.0)]))
    m.unit_finished(a, 0.0)
    frames = drain(m)
    assert kinds(frames) == ["audio.start", "audio.chunk", "audio.chunk", "audio.chunk", "audio.done"]
    chunks = [f for f in frames if isinstance(f, AudioChunk)]
    assert [(c.chunk_id, c.chunk_start_ms, c.chunk_end_ms) for c in chunks] == [(0, 0, 10), (1, 10, 30), (2, 0, 30)]
    assert len(base64.b64decode(chunks[1].audio_b64)) == 960 and chunks[2].audio_b64 == ""
    assert chunks[2].timestamps is not None
    assert [(w.word, w.char_start, w.start_ms) for w in chunks[2].timestamps] == [("One", 4, 0), ("two", 8, 5)]


def test_the_second_unit_of_an_utterance_starts_on_the_first_ones_timeline() -> None:
    m = OutputMachine(2)
    m.commit(unit(0, 0, cfg=BINARY_WORDS), 100.0)
    m.commit(unit(0, 1, cfg=BINARY_WORDS, text="Again.", char_start=13), 100.0)
    a, b = m.take_due()
    m.piece(a, piece(2400))
    m.unit_finished(a, 0.0)
    m.piece(b, piece(240, [(0, 5, 2.0, 9.0)]))
    frames = drain(m)
    words = [f for f in frames if isinstance(f, AudioWords)]
    assert [(w.word, w.start_ms, w.char_start) for w in words[0].words] == [("Again", 102, 13)]


def test_deadlines_count_expected_audio_ahead_then_the_playback_clock() -> None:
    m = OutputMachine(2)
    a = m.commit(unit(0, 0, committed_ms=1000.0), 800.0)
    b = m.commit(unit(0, 1, committed_ms=1100.0), 600.0)
    m.commit(unit(0, 2, committed_ms=1200.0), 400.0)
    assert m.take_due() == [a, b]
    assert (a.deadline_ms, b.deadline_ms) == (1000.0, 1800.0)  # b: once a's expected 800 ms have played
    m.piece(a, piece(4800))  # 200 ms, handed out at 1500
    m.unit_finished(a, 0.0)
    drain(m, 1500.0)
    (c,) = m.take_due()
    assert c.deadline_ms == 1700.0 + 600.0  # dry at 1500 + 200, then b's expected 600 ms


def test_a_new_sessions_backlog_never_asks_before_its_own_commit() -> None:
    m = OutputMachine(1)
    a = m.commit(unit(0, 0, committed_ms=0.0), 10.0)
    m.commit(unit(0, 1, committed_ms=5000.0), 10.0)
    m.take_due()
    m.piece(a, piece(24))
    m.unit_finished(a, 0.0)
    drain(m, 1.0)
    (b,) = m.take_due()
    assert b.deadline_ms == 5000.0


def test_close_without_announcing_ends_every_unit_and_sends_only_queued_events() -> None:
    m = OutputMachine(2)
    a = m.commit(unit(0, 0), 100.0)
    m.commit(unit(0, 1), 100.0)
    m.commit(unit(1, 0), 100.0)
    m.take_due()
    m.piece(a, piece(24))
    drain(m)
    m.emit(ErrorEvent(message="bye", code="internal_error", fatal=True))
    m.close(announce=False)
    assert [o.outcome for o in m.take_ended()] == ["cancelled"] * 3
    assert kinds(drain(m)) == ["error"]
    late = m.commit(unit(2, 0), 100.0)
    assert m.take_ended() == [late] and late.outcome == "cancelled" and m.take_due() == []
    assert not m.busy


def test_close_announcing_pairs_the_started_unit() -> None:
    m = OutputMachine(2)
    m.commit(unit(0, 0), 100.0)
    m.take_due()
    drain(m)
    m.close()
    assert kinds(drain(m)) == ["audio.done"]


def test_an_utterance_without_units_is_done_at_once_in_its_place() -> None:
    m = OutputMachine(2)
    a = m.commit(unit(0, 0), 100.0)
    m.finish_utterance(0, 1)
    m.finish_utterance(1, 0)
    m.take_due()
    assert kinds(drain(m)) == ["audio.start"]
    m.unit_finished(a, 0.0)
    frames = drain(m)
    assert kinds(frames) == ["audio.done", "session.done", "session.done"]
    assert isinstance(frames[2], SessionDone) and frames[2].audio_ms == 0.0


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        OutputMachine(0)


# -- any interleaving -----------------------------------------------------------------------------------

CONFIGS = (BINARY, BINARY_WORDS, JSON, JSON_WORDS)
CONTROL = "control"


@dataclass
class _Seen:
    """What the client has seen of one unit."""

    started: bool = False
    bytes: int = 0
    samples: int = 0
    offset_ms: float = 0.0
    chunks: int = 0
    failed: bool = False
    done: list[AudioDone] = field(default_factory=list)
    expected: deque[tuple[str, int]] = field(default_factory=deque)
    """Frames its rendered pieces should become, in order: ("words", samples) and ("audio", samples)."""


class OutputRules(RuleBasedStateMachine):
    """A runtime driving an `OutputMachine` in every order it can, and a client checking what comes out."""

    @initialize(cap=st.integers(1, 3), cfg=st.sampled_from(CONFIGS))
    def setup(self, cap: int, cfg: EffectiveConfig) -> None:
        self.m = OutputMachine(cap)
        self.cap = cap
        self.cfg = cfg
        self.now = 0.0
        self.committed: list[UnitOutput] = []
        self.running: list[UnitOutput] = []
        """Started (taken as due), synthesis not reported over."""
        self.in_flight: set[int] = set()
        self.ended: dict[int, str] = {}
        self.open: int | None = None
        self.next_utterance = 0
        self.sentences: dict[int, int] = {}
        self.finished: set[int] = set()
        self.cancelled: set[int] = set()
        self.session_done: set[int] = set()
        self.utterance_ms: dict[int, float] = {}
        self.closed_silently = False
        self.closed = False
        self.control_pending = 0
        self.audio_due = False
        self.current: UnitOutput | None = None
        self.seen: dict[int, _Seen] = {}

    # -- the runtime's side

    @rule(estimate=st.floats(0, 5000))
    def commit(self, estimate: float) -> None:
        if self.open is None:
            self.open = self.next_utterance
            self.next_utterance += 1
            self.sentences[self.open] = 0
        index = self.sentences[self.open]
        self.sentences[self.open] += 1
        out = self.m.commit(unit(self.open, index, cfg=self.cfg, committed_ms=self.now), estimate)
        self.committed.append(out)
        self.seen[id(out)] = _Seen()
        self.settle()

    @rule()
    def finish_utterance(self) -> None:
        if self.open is None:
            self.open = self.next_utterance
            self.next_utterance += 1
            self.sentences[self.open] = 0
        self.m.finish_utterance(self.open, self.sentences[self.open])
        self.finished.add(self.open)
        self.open = None

    def cancellable(self) -> list[int]:
        """Utterances the session state machine could still cancel: not done, not cancelled."""
        return [n for n in range(self.next_utterance) if n not in self.session_done and n not in self.cancelled]

    @precondition(lambda self: self.cancellable())
    @rule(data=st.data())
    def cancel_utterance(self, data: st.DataObject) -> None:
        index = data.draw(st.sampled_from(self.cancellable()))
        self.m.cancel_utterance(index, None)
        self.cancelled.add(index)
        if self.open == index:
            self.open = None
        self.settle()

    @rule()
    def emit(self) -> None:
        self.m.emit(ErrorEvent(message="control", code=CONTROL, fatal=False))
        self.control_pending += 1

    @precondition(lambda self: self.running)
    @rule(data=st.data(), samples=st.integers(0, 4800), with_words=st.booleans())
    def render_piece(self, data: st.DataObject, samples: int, with_words: bool) -> None:
        out = data.draw(st.sampled_from(self.running))
        words = [(0, 5, 0.0, samples / RATE * 1000.0)] if with_words else None
        self.m.piece(out, piece(samples, words))
        if out.outcome is None:  # pieces of a dropped unit are ignored
            expected = self.seen[id(out)].expected
            if with_words and self.cfg.word_timestamps and self.cfg.audio_frames == "binary":
                expected.append(("words", samples))
            if samples:
                expected.append(("audio", samples))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), fail=st.booleans(), engine_s=st.floats(0, 2))
    def synthesis_over(self, data: st.DataObject, fail: bool, engine_s: float) -> None:
        out = data.draw(st.sampled_from(self.running))
        self.running.remove(out)
        self.m.unit_finished(out, engine_s, ("generation_failed", "boom") if fail else None)

    @rule(dt=st.floats(0, 500), count=st.integers(1, 3))
    def send(self, dt: float, count: int) -> None:
        self.now += dt
        for _ in range(count):
            frame = self.m.next_output(self.now)
            self.settle()
            if frame is None:
                return
            self.client(frame)

    @rule(announce=st.booleans())
    def close(self, announce: bool) -> None:
        if not announce and self.current is not None:
            self.closed_silently = True
            self.audio_due = False  # the unit is dropped unannounced: nothing more of it comes
        self.closed = True
        self.m.close(announce=announce)
        self.settle()

    def settle(self) -> None:
        for out in self.m.take_ended():
            assert id(out) not in self.ended, "a unit ended twice"
            assert out.outcome is not None
            self.ended[id(out)] = out.outcome
            self.in_flight.discard(id(out))
        for out in self.m.take_due():
            assert out.outcome is None and not self.closed
            assert out.deadline_ms >= out.unit.committed_ms
            earlier = self.committed[: self.committed.index(out)]
            assert all(id(o) in self.in_flight or id(o) in self.ended for o in earlier)  # due in commit order
            self.in_flight.add(id(out))
            self.running.append(out)

    @invariant()
    def in_flight_is_capped(self) -> None:
        if hasattr(self, "m"):
            assert len(self.in_flight) <= self.cap

    # -- the client's side

    def client(self, frame: Frame) -> None:
        audio_due, self.audio_due = self.audio_due, False
        is_audio = isinstance(frame, RenderedPiece) or (isinstance(frame, AudioChunk) and bool(frame.audio_b64))
        if audio_due:
            assert is_audio or (isinstance(frame, AudioDone) and frame.error), "words not followed by their audio"
        if isinstance(frame, ErrorEvent) and frame.code == CONTROL:
            self.control_pending -= 1
            return
        if isinstance(frame, AudioStart | AudioWords | SessionDone) or (is_audio and not audio_due):
            assert self.control_pending == 0, "a unit frame went before a queued control event"
        match frame:
            case AudioStart():
                assert self.current is None, "audio.start before the previous unit's audio.done"
                out = self.find(frame.utterance_index, frame.sentence_index)
                earlier = self.committed[: self.committed.index(out)]
                assert all(self.seen[id(o)].started or self.ended.get(id(o)) == "cancelled" for o in earlier)
                seen = self.seen[id(out)]
                assert not seen.started
                seen.started = True
                seen.offset_ms = self.utterance_ms.get(frame.utterance_index, 0.0)
                self.current = out
            case AudioWords():
                assert self.current is not None and self.cfg.audio_frames == "binary"
                assert (frame.utterance_index, frame.sentence_index) == self.key(self.current)
                expected = self.seen[id(self.current)].expected
                kind, samples = expected.popleft()
                assert kind == "words"
                self.audio_due = bool(samples)
            case RenderedPiece():
                assert self.current is not None and self.cfg.audio_frames == "binary" and frame.data
                self.audio(len(frame.data), frame.samples)
            case AudioChunk() if frame.audio_b64:
                assert self.current is not None and self.cfg.audio_frames == "json"
                seen = self.seen[id(self.current)]
                assert frame.chunk_id == seen.chunks
                assert frame.chunk_start_ms == round(round(seen.samples * 1000.0 / RATE, 2))
                seen.chunks += 1
                size = len(base64.b64decode(frame.audio_b64))
                self.audio(size, size // 2)
                assert frame.chunk_end_ms == round(seen.samples * 1000.0 / RATE)
            case AudioChunk():
                assert self.current is not None and self.cfg.word_timestamps and self.cfg.audio_frames == "json"
                assert frame.chunk_id == self.seen[id(self.current)].chunks
                assert self.ended[id(self.current)] == "ok"
            case ErrorEvent():
                assert self.current is not None and frame.code == "generation_failed"
                assert (frame.utterance_index, frame.sentence_index) == self.key(self.current)
                seen = self.seen[id(self.current)]
                assert frame.partial_audio is (True if seen.bytes else None)
                seen.failed = True
            case AudioDone():
                assert self.current is not None, "audio.done without audio.start"
                assert (frame.utterance_index, frame.sentence_index) == self.key(self.current)
                seen = self.seen[id(self.current)]
                assert frame.total_bytes == seen.bytes == self.current.bytes_sent
                assert frame.audio_ms == round(seen.samples * 1000.0 / RATE, 2)
                outcome = self.ended[id(self.current)]
                assert frame.error == (outcome != "ok")
                if outcome != "cancelled":
                    assert not seen.expected, "a unit ended with rendered audio not sent"
                assert seen.failed == (outcome == "failed")
                seen.done.append(frame)
                self.current = None
            case AudioCancelled():
                assert frame.utterance_index in self.cancelled
                assert frame.audio_ms == pytest.approx(self.utterance_ms.get(frame.utterance_index, 0.0), abs=0.011)
            case SessionDone():
                index = frame.utterance_index
                assert self.current is None and index in self.finished and index not in self.cancelled
                assert index not in self.session_done
                self.session_done.add(index)
                units = [o for o in self.committed if o.unit.utterance_index == index]
                assert frame.total_sentences == len(units)
                assert all(self.ended.get(id(o)) in ("ok", "failed") and self.seen[id(o)].done for o in units)
                assert frame.audio_ms == pytest.approx(self.utterance_ms.get(index, 0.0), abs=0.011)
            case _:
                raise AssertionError(f"unexpected frame {frame!r}")

    def audio(self, size: int, samples: int) -> None:
        assert self.current is not None
        seen = self.seen[id(self.current)]
        assert seen.expected.popleft() == ("audio", samples), "audio out of order, lost or made up"
        assert size == 2 * samples
        seen.bytes += size
        seen.samples += samples
        self.utterance_ms[self.current.unit.utterance_index] = seen.offset_ms + seen.samples * 1000.0 / RATE

    def find(self, utterance: int, sentence: int) -> UnitOutput:
        return next(o for o in self.committed if self.key(o) == (utterance, sentence))

    @staticmethod
    def key(out: UnitOutput) -> tuple[int, int]:
        return out.unit.utterance_index, out.unit.sentence_index

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        # Let everything still running finish, and drain; then close announcing, and drain again.
        if self.open is not None:
            self.finish_utterance()
        for _ in range(100_000):
            for out in list(self.running):
                self.running.remove(out)
                self.m.unit_finished(out, 0.0)
            frame = self.m.next_output(self.now)
            self.settle()
            if frame is not None:
                self.client(frame)
            elif not self.running:
                break
        else:
            raise AssertionError("the output never ran dry")
        if not self.closed:
            finished = self.finished - self.cancelled
            assert self.session_done == finished, "an utterance input.done'd and not cancelled got no session.done"
        self.m.close()
        self.settle()
        for frame in drain(self.m, self.now):
            self.client(frame)
        assert self.control_pending == 0 and not self.m.busy
        assert set(self.ended) == {id(o) for o in self.committed}, "a committed unit never ended"
        for out in self.committed:
            seen = self.seen[id(out)]
            if seen.started and not (self.closed_silently and not seen.done):
                assert len(seen.done) == 1, "audio.start without exactly one audio.done"
            assert len(seen.done) <= 1
            if self.ended[id(out)] in ("ok", "failed"):
                assert seen.done and seen.done[0].error == (self.ended[id(out)] == "failed")


OutputRules.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_output_machine_under_any_interleaving = OutputRules.TestCase
