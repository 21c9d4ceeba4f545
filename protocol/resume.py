"""Session resume, sans I/O: the numbered record of what a session sent, and who may resume which session.

Sequence numbers. Every frame the server sends in a session, text or binary, takes the next number from 1
(`ReplayLog.record`). Text events carry theirs in `seq` (and `input_seq`, the number of client messages
applied so far); binary frames carry none: a client that counts every frame it receives always knows the
number of the last one. Frames outside the numbering: `session.resumed` and the `error` that refuses a
resume or ends a socket that another one took over (they belong to one connection, not to the session).

Client messages are numbered the same way on the client's side: every message but `session.ack` and
`session.resume`, from 1, across connections. The server applies each once, in order, and says how many it
has applied (`input_seq`), so a client resends only what is missing after a resume.

`ReplayLog` keeps the frames the client has not acknowledged (`session.ack`), so a resume replays exactly
the frames after the last one the client received, in order, once. Before the client's first
acknowledgement (a client that does not resume, such as a vllm-omni client) it is a ring of at most
`cap_bytes` of frames already sent; from the first acknowledgement on it never drops an unacknowledged
frame, and `room` says when the session must stop producing until the client acknowledges (or resumes).

`ResumeRegistry` maps session ids to sessions, each with the digest of its resume token and the API key id
that opened it, keeps a session whose connection dropped for `window_s`, and remembers for a while why a
session can no longer be resumed, so each refusal says what happened.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from voicewire.protocol.messages import ProtocolError

TOKEN_PREFIX: Final = "vwr_"
TOKEN_BYTES: Final = 32
"""Entropy of a resume token (256 bits: unguessable)."""

T = TypeVar("T")
Frame = str | bytes


def stamp(event_json: bytes, seq: int, input_seq: int) -> str:
    """The text of a numbered event: `event_json` (one JSON object, as `msgspec` encodes an event) with
    `seq` and `input_seq` appended as its last fields."""
    assert event_json[-1:] == b"}", event_json[-20:]
    return (event_json[:-1] + b',"seq":%d,"input_seq":%d}' % (seq, input_seq)).decode()


class ReplayLog:
    """The frames of one session that the client may not have received, by sequence number.

    Memory: at most `cap_bytes` plus one frame (a frame larger than the cap is kept alone), because the
    session records a frame only when `room` is true.
    """

    def __init__(self, cap_bytes: int) -> None:
        if cap_bytes < 1:
            raise ValueError("cap_bytes must be >= 1")
        self.cap_bytes = cap_bytes
        self.first_seq = 1
        """Sequence number of the oldest frame kept (`last_seq + 1` when none is)."""
        self.last_seq = 0
        """Sequence number of the last frame recorded (0 before the first)."""
        self.held_bytes = 0
        self.acknowledged = False
        """The client sent `session.ack` at least once: it resumes, so no unacknowledged frame is dropped."""
        self._frames: deque[tuple[Frame, int]] = deque()

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def room(self) -> bool:
        """Whether another frame may be recorded: always before the first acknowledgement (the ring drops
        old frames instead), then while less than `cap_bytes` is kept."""
        return not self.acknowledged or self.held_bytes < self.cap_bytes

    def record(self, frame: Frame, size: int | None = None) -> int:
        """Keep `frame` (of `size` bytes on the wire; `len(frame)` by default) under the next number, which
        is returned."""
        size = len(frame) if size is None else size
        self._frames.append((frame, size))
        self.held_bytes += size
        self.last_seq += 1
        return self.last_seq

    def frame(self, seq: int) -> Frame:
        """The frame numbered `seq` (kept: `first_seq <= seq <= last_seq`)."""
        if not self.first_seq <= seq <= self.last_seq:
            raise IndexError(seq)
        return self._frames[seq - self.first_seq][0]

    def sent(self, seq: int) -> None:
        """Frames up to `seq` went out on a connection. Before the first acknowledgement, the oldest of them
        are dropped while more than `cap_bytes` is kept (no client resumes them but a late one)."""
        if self.acknowledged:
            return
        while self._frames and self.held_bytes > self.cap_bytes and self.first_seq <= seq:
            self._drop_first()

    def ack(self, seq: int) -> None:
        """The client received every frame up to `seq`: forget them. Raises `ProtocolError` (`invalid_ack`)
        for a number the server never sent; an older number than a previous ack is harmless."""
        if seq > self.last_seq or seq < 0:
            raise ProtocolError("invalid_ack", f"session.ack seq {seq} is past the last frame sent "
                                f"({self.last_seq})", param="seq")
        self.acknowledged = True
        while self._frames and self.first_seq <= seq:
            self._drop_first()

    def check_resume(self, seq: int) -> None:
        """Raise `ProtocolError` (`resume_gap`, fatal) unless every frame after `seq` is kept."""
        if seq > self.last_seq or seq < 0:
            raise ProtocolError("resume_gap", f"Cannot resume: the client says it received frame {seq}, but the "
                                f"session has sent only {self.last_seq}", fatal=True, param="seq")
        if seq < self.first_seq - 1:
            raise ProtocolError("resume_gap", f"Cannot resume: frames {seq + 1} to {self.first_seq - 1} are no "
                                "longer kept (the client never acknowledged them with session.ack and the replay "
                                "buffer dropped them)", fatal=True, param="seq")

    def _drop_first(self) -> None:
        _frame, size = self._frames.popleft()
        self.held_bytes -= size
        self.first_seq += 1


def new_token() -> str:
    """A fresh resume token: `vwr_` and 256 random bits, URL-safe."""
    return TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def token_digest(token: str) -> bytes:
    """What the server keeps of a token (never the token itself)."""
    return hashlib.sha256(token.encode()).digest()


def token_matches(digest: bytes, token: str) -> bool:
    """Whether `token` is the one `digest` was made from, compared in constant time."""
    return hmac.compare_digest(digest, token_digest(token))


@dataclass(slots=True)
class _Live(Generic[T]):
    session: T
    key: str | None
    digest: bytes
    expires_at: float | None = None
    """While no connection is attached: when the session ends unless resumed."""


@dataclass(frozen=True, slots=True)
class _Ended:
    key: str | None
    digest: bytes
    reason: str
    at: float


class ResumeRegistry(Generic[T]):
    """The resumable sessions of one server, by session id. Time comes in as arguments (seconds, any
    monotonic clock).

    A session is registered when it is created (`register`, which makes its token), marked `detached` when
    its connection drops and `attached` when one resumes it, and `ended` when it ends (or `expired`, which
    ends those whose window passed). `claim` checks a resume request and returns the session.
    Ended sessions are remembered (`remember_s`, at most `max_remembered`) only to explain refusals.
    """

    def __init__(self, window_s: float, *, remember_s: float = 600.0, max_remembered: int = 4096) -> None:
        self.window_s = window_s
        self.remember_s = remember_s
        self.max_remembered = max_remembered
        self._live: dict[str, _Live[T]] = {}
        self._ended: OrderedDict[str, _Ended] = OrderedDict()

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    @property
    def waiting(self) -> int:
        """Sessions without a connection, waiting to be resumed."""
        return sum(1 for live in self._live.values() if live.expires_at is not None)

    def register(self, session_id: str, key: str | None, session: T) -> str:
        """Add a session opened with API key id `key` (None on an open server); returns its resume token."""
        token = new_token()
        self._live[session_id] = _Live(session, key, token_digest(token))
        return token

    def detached(self, session_id: str, now: float) -> float:
        """Its connection dropped: keep it until `now + window_s` (returned)."""
        live = self._live[session_id]
        live.expires_at = now + self.window_s
        return live.expires_at

    def attached(self, session_id: str) -> None:
        """A connection serves it again: it no longer expires."""
        self._live[session_id].expires_at = None

    def ended(self, session_id: str, reason: str, now: float) -> None:
        """It ended (`reason` completes "it ..." in the refusal of a later resume). Idempotent."""
        live = self._live.pop(session_id, None)
        if live is None:
            return
        self._ended[session_id] = _Ended(live.key, live.digest, reason, now)
        self._forget(now)

    def expired(self, now: float) -> list[T]:
        """End the sessions whose window passed and return them (the caller stops them)."""
        gone = [sid for sid, live in self._live.items() if live.expires_at is not None and live.expires_at <= now]
        sessions = [self._live[sid].session for sid in gone]
        for sid in gone:
            self.ended(sid, f"was not resumed within {self.window_s:g} s of its connection dropping", now)
        return sessions

    def next_expiry(self) -> float | None:
        """The earliest time `expired` has work, or None."""
        times = [live.expires_at for live in self._live.values() if live.expires_at is not None]
        return min(times) if times else None

    def claim(self, session_id: str, token: str, key: str | None) -> T:
        """The session a resume request names, if `token` is its token and `key` the API key id that opened
        it; else raise a fatal `ProtocolError`: `resume_denied` (wrong token, or another key: the message
        says which only to a caller that holds the right token), `resume_expired` (it ended; the message
        says how), `resume_unknown` (no such session here)."""
        live = self._live.get(session_id)
        record: _Live[T] | _Ended | None = live if live is not None else self._ended.get(session_id)
        if record is None:
            raise ProtocolError("resume_unknown", f"Cannot resume: no session {session_id!r} on this server (it "
                                "never existed here, or it ended long ago; a resume must reach the server that "
                                "holds the session)", fatal=True, param="session_id")
        if not token_matches(record.digest, token):
            raise ProtocolError("resume_denied", f"Cannot resume session {session_id!r}: the resume token does "
                                "not match", fatal=True, param="token")
        if record.key != key:
            raise ProtocolError("resume_denied", f"Cannot resume session {session_id!r}: it was opened with "
                                "another API key; resume it with the same key", fatal=True)
        if isinstance(record, _Ended):
            raise ProtocolError("resume_expired", f"Cannot resume session {session_id!r}: it {record.reason}",
                                fatal=True)
        return record.session

    def _forget(self, now: float) -> None:
        ended = self._ended
        while ended and (len(ended) > self.max_remembered
                         or next(iter(ended.values())).at + self.remember_s <= now):
            ended.popitem(last=False)
