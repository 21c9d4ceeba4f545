"""protocol/resume.py without a socket: frame numbering, the replay log's bounds and the resume registry."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from voicewire.protocol.messages import (
    ProtocolError,
    SessionAck,
    SessionResume,
    decode_client_message,
)
from voicewire.protocol.resume import ReplayLog, ResumeRegistry, stamp, token_digest, token_matches


def test_stamp_appends_seq_and_input_seq_as_json_fields() -> None:
    text = stamp(b'{"type":"audio.done","total_bytes":3}', 17, 4)
    assert json.loads(text) == {"type": "audio.done", "total_bytes": 3, "seq": 17, "input_seq": 4}


def test_resume_messages_decode() -> None:
    assert decode_client_message('{"type":"session.ack","seq":3}') == SessionAck(seq=3)
    assert decode_client_message('{"type":"session.resume","session_id":"s","token":"t","seq":0}') == \
        SessionResume(session_id="s", token="t", seq=0)
    with pytest.raises(ProtocolError) as err:
        decode_client_message('{"type":"session.ack","seq":-1}')
    assert err.value.code == "invalid_message"


def test_frames_are_numbered_from_one_and_replayed_after_the_clients_seq() -> None:
    log = ReplayLog(1000)
    assert [log.record(f) for f in ("a", b"bb", "c")] == [1, 2, 3]
    log.check_resume(1)
    assert [log.frame(n) for n in range(2, log.last_seq + 1)] == [b"bb", "c"]
    log.ack(2)
    assert log.first_seq == 3 and log.held_bytes == 1
    log.check_resume(2)
    log.check_resume(3)
    with pytest.raises(ProtocolError) as gap:
        log.check_resume(1)  # frame 2 was acknowledged and dropped: a client saying it lacks it is wrong
    assert gap.value.code == "resume_gap" and gap.value.fatal
    with pytest.raises(ProtocolError) as ahead:
        log.check_resume(4)
    assert ahead.value.code == "resume_gap"


def test_ack_past_the_last_frame_is_refused_and_older_acks_are_harmless() -> None:
    log = ReplayLog(1000)
    log.record("a")
    log.record("b")
    log.ack(2)
    log.ack(1)
    assert log.first_seq == 3 and len(log) == 0
    with pytest.raises(ProtocolError) as err:
        log.ack(3)
    assert err.value.code == "invalid_ack"


def test_before_the_first_ack_the_log_is_a_ring_of_sent_frames() -> None:
    log = ReplayLog(10)
    for _ in range(5):
        log.record("xxxx")
        log.sent(log.last_seq)
        assert log.room
    assert log.held_bytes <= 10 + 4 and log.first_seq == 4
    with pytest.raises(ProtocolError):
        log.check_resume(1)


def test_after_the_first_ack_nothing_unacknowledged_is_dropped_and_room_runs_out() -> None:
    log = ReplayLog(10)
    log.record("xx")
    log.ack(1)
    for _ in range(3):
        assert log.room
        log.record("xxxx")
        log.sent(log.last_seq)
    assert not log.room and log.held_bytes == 12 and log.first_seq == 2
    log.ack(3)
    assert log.room and log.held_bytes == 4


@given(st.lists(st.tuples(st.integers(1, 50), st.integers(0, 5)), max_size=60), st.integers(1, 100))
def test_a_resume_from_any_kept_point_replays_exactly_the_missing_frames(steps: list[tuple[int, int]],
                                                                         cap: int) -> None:
    """Record frames while there is room, ack some, and check that every seq the log accepts for a resume
    replays exactly the frames after it, that memory stays within the cap plus one frame, and that nothing
    unacknowledged is lost once the client acknowledges."""
    log = ReplayLog(cap)
    sent: list[bytes] = []
    acked = 0
    log.ack(0)
    for size, ack_lag in steps:
        if log.room:
            frame = bytes([len(sent) % 256]) * size
            sent.append(frame)
            assert log.record(frame) == len(sent)
        assert log.held_bytes <= cap + 50
        target = max(acked, len(sent) - ack_lag)
        log.ack(target)
        acked = target
    for seq in range(acked, len(sent) + 1):
        log.check_resume(seq)
        assert [log.frame(n) for n in range(seq + 1, log.last_seq + 1)] == sent[seq:]


def test_tokens_are_unguessable_and_compared_by_digest() -> None:
    registry: ResumeRegistry[str] = ResumeRegistry(30.0)
    a = registry.register("s1", "k1", "one")
    b = registry.register("s2", "k1", "two")
    assert a != b and a.startswith("vwr_") and len(a) > 40
    assert token_matches(token_digest(a), a) and not token_matches(token_digest(a), b)


def _code(registry: ResumeRegistry[str], sid: str, token: str, key: str | None) -> str:
    with pytest.raises(ProtocolError) as err:
        registry.claim(sid, token, key)
    assert err.value.fatal
    return err.value.code


def test_claim_refusals_each_say_what_happened() -> None:
    registry: ResumeRegistry[str] = ResumeRegistry(30.0)
    token = registry.register("s1", "k1", "one")
    assert registry.claim("s1", token, "k1") == "one"
    assert _code(registry, "s1", token + "x", "k1") == "resume_denied"
    assert _code(registry, "s1", token, "k2") == "resume_denied"
    assert _code(registry, "nope", token, "k1") == "resume_unknown"
    registry.ended("s1", "was closed with session.close", now=5.0)
    assert _code(registry, "s1", token, "k1") == "resume_expired"
    assert _code(registry, "s1", "vwr_wrong", "k1") == "resume_denied"  # no hint without the token


def test_detached_sessions_expire_after_the_window_and_attached_ones_never() -> None:
    registry: ResumeRegistry[str] = ResumeRegistry(30.0)
    t1 = registry.register("s1", None, "one")
    registry.register("s2", None, "two")
    assert registry.detached("s1", now=100.0) == 130.0
    registry.detached("s2", now=110.0)
    registry.attached("s2")
    assert registry.waiting == 1 and registry.next_expiry() == 130.0
    assert registry.expired(129.9) == []
    assert registry.expired(130.0) == ["one"]
    assert "s1" not in registry and "s2" in registry and registry.next_expiry() is None
    with pytest.raises(ProtocolError) as err:
        registry.claim("s1", t1, None)
    assert err.value.code == "resume_expired" and "within 30 s" in err.value.message


def test_ended_sessions_are_remembered_for_a_while_only() -> None:
    registry: ResumeRegistry[str] = ResumeRegistry(30.0, remember_s=10.0, max_remembered=2)
    tokens = [registry.register(f"s{i}", None, str(i)) for i in range(3)]
    for i in range(3):
        registry.ended(f"s{i}", "ended", now=float(i))
    assert _code(registry, "s0", tokens[0], None) == "resume_unknown"  # past max_remembered
    assert _code(registry, "s2", tokens[2], None) == "resume_expired"
    registry.register("s9", None, "9")
    registry.ended("s9", "ended", now=20.0)  # s1 and s2 are older than remember_s now
    assert _code(registry, "s2", tokens[2], None) == "resume_unknown"
