"""Resume end to end: a real server on loopback, a real TCP proxy that cuts the connection at a chosen byte,
and a client that resumes by the wire protocol alone (session.ack, ?session_id=, session.resume)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import re
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from voicewire.realtime.settings import Settings
from voicewire_client import AudioData, AudioWords, Session, SessionDone
from voicewire_client import connect as client_connect
from voicewire_client.session import ACK_EVERY_BYTES
from websockets.asyncio.client import ClientConnection

from tests.proxy import Proxy
from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

TEXT = "Hello there, my friend. The weather is fine today! Shall we walk to the river? I think we should."
T = TypeVar("T")
CONFIG: dict[str, Any] = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True,
                          "word_timestamps": True, "audio_frames": "binary", "seed": 7}


@dataclasses.dataclass
class Stream:
    """What a client received of one session, in order, with the frame count a resume needs."""

    items: list[dict[str, Any] | bytes] = dataclasses.field(default_factory=list)
    seq: int = 0
    input_seq: int = 0

    def audio(self) -> bytes:
        return b"".join(i for i in self.items if isinstance(i, bytes))

    def events(self, drop: tuple[str, ...] = ("seq", "input_seq")) -> list[dict[str, Any]]:
        return [{k: v for k, v in i.items() if k not in drop} for i in self.items if isinstance(i, dict)]

    def shape(self) -> list[str]:
        return [f"<{len(i)}>" if isinstance(i, bytes) else str(i["type"]) for i in self.items]


class ResumingClient:
    """A client that numbers what it sends, acknowledges what it receives, and resumes after a drop."""

    def __init__(self, server: ServerThread, url: str) -> None:
        self.server = server
        self.url = url
        self.ws: ClientConnection | None = None
        self.sent: list[dict[str, Any]] = []
        self.got = Stream()
        self.session_id = ""
        self.token = ""
        self.ports: list[int] = []
        """The local port of each connection it opened (the server's peer port, unless through a proxy)."""

    async def _dial(self, url: str) -> ClientConnection:
        ws = await websockets.connect(url, max_size=None)
        self.ports.append(ws.local_address[1])
        return ws

    async def open(self) -> dict[str, Any]:
        self.ws = await self._dial(self.url)
        await self.send({"type": "session.config", **CONFIG})
        updated = await recv_until(self.ws, "session.updated")
        event = updated.events[-1]
        self.got.items.append(event)
        self.got.seq = event["seq"]
        self.session_id, self.token = event["session_id"], event["resume_token"]
        await self.ws.send(json.dumps({"type": "session.ack", "seq": self.got.seq}))
        return event

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        assert self.ws is not None
        with contextlib.suppress(websockets.ConnectionClosed):
            await self.ws.send(json.dumps(message))

    async def receive_until(self, kind: str) -> bool:
        """Read frames until an event of `kind`; False when the connection drops first."""
        assert self.ws is not None
        while True:
            try:
                frame = await self.ws.recv()
            except websockets.ConnectionClosed:
                return False
            self.got.seq += 1
            event: dict[str, Any] | None = None
            if isinstance(frame, bytes):
                self.got.items.append(frame)
            else:
                event = json.loads(frame)
                assert event["seq"] == self.got.seq, (event, self.got.seq)
                self.got.input_seq = max(self.got.input_seq, event["input_seq"])
                self.got.items.append(event)
            with contextlib.suppress(websockets.ConnectionClosed):
                await self.ws.send(json.dumps({"type": "session.ack", "seq": self.got.seq}))
            if event is not None and event["type"] == kind:
                return True

    async def resume(self, query: str = "", *, token: str | None = None, close_old: bool = True,
                     base: str | None = None) -> dict[str, Any]:
        """Reconnect (to `base`, default the server directly) with `?session_id=` (and `query`), send
        `session.resume`, resend what the server did not apply. Returns the server's answer
        (`session.resumed`, or the refusing `error`)."""
        if close_old and self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
        url = f"{base or self.server.ws_url}?session_id={self.session_id}{query}"
        self.ws = await self._dial(url)
        await self.ws.send(json.dumps({"type": "session.resume", "session_id": self.session_id,
                                       "token": token or self.token, "seq": self.got.seq}))
        answer = json.loads(await self.ws.recv())
        if answer["type"] == "session.resumed":
            assert "seq" not in answer or answer["seq"] == self.got.seq
            for message in self.sent[answer["input_seq"]:]:
                await self.ws.send(json.dumps(message))
        return answer


async def _reference(server: ServerThread, deltas: list[str]) -> Stream:
    """What an uncut run of `deltas` receives; returns once the server ended its session (so a server of
    one session takes the next)."""
    client = ResumingClient(server, server.ws_url)
    await client.open()
    for delta in deltas:
        await client.send({"type": "input.text", "text": delta})
    await client.send({"type": "input.done"})
    assert await client.receive_until("session.done")
    assert client.ws is not None
    await client.ws.close()
    await _assert_gone(server, client.session_id)
    return client.got


def _deltas(text: str) -> list[str]:
    return [text[i:i + 7] for i in range(0, len(text), 7)]


async def _until_waiting(server: ServerThread, session_id: str) -> None:
    """Until the server noticed the drop (the session waits for a resume)."""
    async def poll() -> bool:
        return any(getattr(s, "session_id", None) == session_id and getattr(s, "waiting", False)
                   for s in server.ctx.sessions)
    async with asyncio.timeout(30):
        while not await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(poll(), server.loop)):
            await asyncio.sleep(0.02)


async def _on_server(server: ServerThread, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work(), server.loop))


async def _runtime_ref(server: ServerThread, session_id: str) -> weakref.ref[Any]:
    """A weak reference to the server's runtime of a session (with its replay log): dead once it is freed."""
    async def find() -> weakref.ref[Any]:
        return weakref.ref(next(s for s in server.ctx.sessions if s.session_id == session_id))  # type: ignore[attr-defined]
    return await _on_server(server, find)


async def _assert_gone(server: ServerThread, session_id: str, ports: Iterable[int] = (),
                       runtime: weakref.ref[Any] | None = None) -> None:
    """After the session ended: no trace of it on the server: no session, registry entry or task, no TCP
    connection open from `ports` (the client ports of its connections, as the server sees them), and its
    runtime (`_runtime_ref`), replay log included, freed."""
    ports = set(ports)

    async def traces() -> list[str]:
        found = [f"session {s.session_id}" for s in server.ctx.sessions  # type: ignore[attr-defined]
                 if s.session_id == session_id]  # type: ignore[attr-defined]
        found += ["registry"] if session_id in server.ctx.resumes else []
        found += [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith(session_id)]
        found += [f"socket from port {p}" for p in ports & await server.open_peer_ports()]
        if not found and runtime is not None:
            gc.collect()
            found += ["runtime"] if runtime() is not None else []
        return found
    left = await _on_server(server, traces)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            while left:
                await asyncio.sleep(0.05)
                left = await _on_server(server, traces)
    assert not left, f"left on the server after the session ended: {left}"


async def _close(client: ResumingClient, proxy: Proxy | None = None) -> None:
    """Close the session with `session.close` and check the server kept nothing of it (the connections
    through `proxy` included)."""
    runtime = await _runtime_ref(client.server, client.session_id)
    await client.send({"type": "session.close"})
    assert not await client.receive_until("never")
    ports = [*client.ports, *(proxy.upstream_ports if proxy is not None else ())]
    await _assert_gone(client.server, client.session_id, ports, runtime)


def _assert_same(resumed: Stream, reference: Stream) -> None:
    """Byte-identical audio, the same events (timings aside) in the same order, nothing twice."""
    assert resumed.audio() == reference.audio()
    drop = ("seq", "input_seq", "timings", "session_id", "resume_token")
    assert resumed.events(drop) == reference.events(drop)
    seqs = [i["seq"] for i in resumed.items if isinstance(i, dict)]
    assert seqs == sorted(set(seqs))


@pytest.mark.parametrize("cut_fraction", [0.0, 0.13, 0.5, 0.87])
async def test_a_connection_cut_anywhere_in_the_audio_resumes_without_loss_or_repeat(
        server: ServerThread, cut_fraction: float) -> None:
    deltas = _deltas(TEXT)
    reference = await _reference_of(server, deltas)
    total = sum(len(i) if isinstance(i, bytes) else len(json.dumps(i)) for i in reference.items)
    async with Proxy(server.port) as proxy:
        client = ResumingClient(server, proxy.url())
        updated = await client.open()
        # Past session.updated: the server received the ack (sent before any text) by then.
        proxy.limits["down"] = proxy.passed["down"] + 1 + int(cut_fraction * total)
        for delta in deltas:
            await client.send({"type": "input.text", "text": delta})
        await client.send({"type": "input.done"})
        finished = await client.receive_until("session.done")
        assert not finished and proxy.cut.is_set()
    await _until_waiting(server, client.session_id)
    answer = await client.resume()
    assert answer["type"] == "session.resumed", answer
    assert answer["session_id"] == updated["session_id"] and answer["seq"] == client.got.seq
    assert await client.receive_until("session.done")
    _assert_same(client.got, reference)
    await _close(client, proxy)


async def test_a_cut_while_text_streams_resends_only_what_the_server_did_not_apply(server: ServerThread) -> None:
    deltas = _deltas(TEXT)
    reference = await _reference_of(server, deltas)
    async with Proxy(server.port) as proxy:
        client = ResumingClient(server, proxy.url())
        await client.open()
        proxy.limits["up"] = proxy.passed["up"] + 300  # mid-message, a few deltas in
        for delta in deltas:
            await client.send({"type": "input.text", "text": delta})
            await asyncio.sleep(0)
        await client.send({"type": "input.done"})
        await proxy.cut.wait()
        assert not await client.receive_until("session.done")
    await _until_waiting(server, client.session_id)
    answer = await client.resume()
    assert answer["type"] == "session.resumed", answer
    assert 0 < answer["input_seq"] < len(client.sent)
    assert await client.receive_until("session.done")
    _assert_same(client.got, reference)
    await _close(client, proxy)


async def _dropped_session(server: ServerThread) -> tuple[ResumingClient, Proxy]:
    proxy = Proxy(server.port)
    await proxy.__aenter__()
    client = ResumingClient(server, proxy.url())
    await client.open()
    await client.send({"type": "input.text", "text": "Hi."})
    await client.send({"type": "input.done"})
    assert await client.receive_until("session.done")  # so the server has the client's first ack
    proxy.abort()
    await _until_waiting(server, client.session_id)
    return client, proxy


async def test_wrong_token_and_unknown_session_are_refused_and_the_session_still_resumes(
        server: ServerThread) -> None:
    client, proxy = await _dropped_session(server)
    refused = await client.resume(token="vwr_" + "A" * 43)
    assert refused["type"] == "error" and refused["code"] == "resume_denied" and refused["fatal"]
    assert "seq" not in refused
    saved = client.session_id
    client.session_id = "sess_999999"
    unknown = await client.resume()
    assert unknown["code"] == "resume_unknown"
    client.session_id = saved
    answer = await client.resume()
    assert answer["type"] == "session.resumed"
    await client.send({"type": "input.text", "text": "Still here."})
    await client.send({"type": "input.done"})
    assert await client.receive_until("session.done")
    await _close(client, proxy)  # the taken-over and refused connections included
    await proxy.__aexit__()


async def test_a_second_resume_takes_over_and_the_first_connection_is_told_why(server: ServerThread) -> None:
    client, proxy = await _dropped_session(server)
    first = await client.resume()
    assert first["type"] == "session.resumed"
    first_ws = client.ws
    second = await client.resume(close_old=False)
    assert second["type"] == "session.resumed"
    assert first_ws is not None
    told = json.loads(await first_ws.recv())
    assert told["code"] == "session_taken_over" and told["fatal"] and "seq" not in told
    with pytest.raises(websockets.ConnectionClosed):
        await first_ws.recv()
    assert first_ws.close_code == 1008
    await client.send({"type": "input.text", "text": "Second socket."})
    await client.send({"type": "input.done"})
    assert await client.receive_until("session.done")
    await _close(client, proxy)  # the taken-over and refused connections included
    await proxy.__aexit__()


@pytest.mark.parametrize("speaking", [False, True])
async def test_a_close_frame_from_the_client_ends_a_resumable_session_at_once(server: ServerThread,
                                                                               speaking: bool) -> None:
    """A client that closes its WebSocket (a close frame, no `session.close`), idle or mid-answer, ended the
    session on purpose: the server keeps nothing of it (it does not wait for a resume), and a resume is
    refused."""
    client = ResumingClient(server, server.ws_url)
    await client.open()
    await _until_acknowledged(server, client.session_id)
    runtime = await _runtime_ref(server, client.session_id)
    if speaking:
        await client.send({"type": "input.text", "text": LONG})
        await client.send({"type": "input.done"})
        assert await client.receive_until("audio.start")
    assert client.ws is not None
    await client.ws.close()
    await _assert_gone(server, client.session_id, client.ports, runtime)
    answer = await client.resume()
    assert answer["code"] == "resume_expired" and "connection closed" in answer["message"], answer


async def test_a_client_that_never_acknowledges_keeps_disconnect_is_cancel(server: ServerThread) -> None:
    async with Proxy(server.port) as proxy:
        ws = await websockets.connect(proxy.url())
        updated = await configure(ws, **CONFIG)
        await send(ws, {"type": "input.text", "text": TEXT})
        proxy.abort()
    token = updated["resume_token"]
    async with websockets.connect(f"{server.ws_url}?session_id={updated['session_id']}") as again:
        await again.send(json.dumps({"type": "session.resume", "session_id": updated["session_id"],
                                     "token": token, "seq": 1}))
        answer = json.loads(await again.recv())
    assert answer["code"] == "resume_expired", answer



async def _audio_until_done(session: Session) -> bytes:
    """The audio `session` yields up to its utterance's `session.done`."""
    audio = b""
    async for item in session:
        if isinstance(item, AudioData):
            audio += item.data
        elif isinstance(item, SessionDone):
            break
    return audio


async def test_the_python_client_resumes_by_itself_and_yields_every_frame_once(server: ServerThread) -> None:
    deltas = _deltas(TEXT)
    reference = await _reference_of(server, deltas)
    async with Proxy(server.port) as proxy, client_connect(proxy.url()) as session:
        await session.configure(**CONFIG)
        proxy.limits["down"] = proxy.passed["down"] + len(reference.audio()) // 2
        for delta in deltas:
            await session.send_text(delta)
        await session.done()
        audio = await _audio_until_done(session)
        assert proxy.cut.is_set() and session.reconnects == 1
        assert audio == reference.audio()


async def test_a_cut_right_after_a_cancel_resumes_with_the_cancel_applied_once(server: ServerThread) -> None:
    async with Proxy(server.port) as proxy:
        client = ResumingClient(server, proxy.url())
        await client.open()
        for delta in _deltas(TEXT):
            await client.send({"type": "input.text", "text": delta})
        assert await client.receive_until("audio.start")
        await client.send({"type": "input.cancel"})
        proxy.abort()
    await _until_waiting(server, client.session_id)
    answer = await client.resume()
    assert answer["type"] == "session.resumed", answer
    assert await client.receive_until("audio.cancelled")
    events = client.got.events()
    assert [e["type"] for e in events].count("audio.cancelled") == 1
    after = client.got.items[client.got.items.index(next(i for i in client.got.items if isinstance(i, dict)
                                                        and i["type"] == "audio.cancelled")) + 1:]
    assert not any(isinstance(i, bytes) for i in after)
    starts = [e for e in events if e["type"] == "audio.start"]
    dones = [e for e in events if e["type"] == "audio.done"]
    assert len(starts) == len(dones)  # every unit started is closed, also across the cut
    await client.send({"type": "input.text", "text": "A new answer."})
    await client.send({"type": "input.done"})
    assert await client.receive_until("session.done")
    await _close(client, proxy)


LONG = " ".join(f"Sentence number {n} is here to make the answer long enough." for n in range(1, 9))


async def _runtime_state(server: ServerThread, session_id: str) -> tuple[int, int, int, int]:
    """(engine requests started, its unit tasks alive, replay bytes held, replay cap) of a session, read
    on the server's loop."""
    async def read() -> tuple[int, int, int, int]:
        runtime = next(s for s in server.ctx.sessions if s.session_id == session_id)  # type: ignore[attr-defined]
        units = sum(1 for t in asyncio.all_tasks() if re.fullmatch(rf"{session_id}-\d+-\d+", t.get_name()))
        return runtime.engine_requests_started, units, runtime.replay.held_bytes, runtime.replay.cap_bytes
    return await _on_server(server, read)


async def _cut_mid_answer(server: ServerThread, proxy: Proxy) -> ResumingClient:
    """A resumable client speaking `LONG` through `proxy`, cut at its first `audio.start`; returns once the
    server noticed (the session waits for a resume)."""
    client = ResumingClient(server, proxy.url())
    await client.open()
    await client.send({"type": "input.text", "text": LONG})
    await client.send({"type": "input.done"})
    assert await client.receive_until("audio.start")
    proxy.abort()
    await _until_waiting(server, client.session_id)
    return client


async def _until_units_ended(server: ServerThread, session_id: str) -> tuple[int, int, int]:
    """Until no unit task of the session is alive: (engine requests started, replay bytes held, cap)."""
    async with asyncio.timeout(60):
        while True:
            started, units, held, cap = await _runtime_state(server, session_id)
            if units == 0:
                return started, held, cap
            await asyncio.sleep(0.02)


async def test_a_waiting_session_finishes_its_units_in_flight_and_starts_no_other(server: ServerThread) -> None:
    """While it waits, the session holds no engine slot beyond its units in flight: once those ended,
    nothing else has started (the replay buffer has room, so only the wait holds the rest back), and the
    resume gets the whole answer."""
    reference = await _reference_of(server, [LONG])
    async with Proxy(server.port) as proxy:
        client = await _cut_mid_answer(server, proxy)
        started, _units, _held, _cap = await _runtime_state(server, client.session_id)
        assert started <= server.settings.max_units_in_flight + 1
        ended_started, held, cap = await _until_units_ended(server, client.session_id)
        assert ended_started == started, "a unit started while the session waited for a resume"
        assert held < cap and started < sum(1 for e in reference.events() if e["type"] == "audio.start")
        answer = await client.resume()
        assert answer["type"] == "session.resumed", answer
        assert await client.receive_until("session.done")
        _assert_same(client.got, reference)
        await _close(client, proxy)


@pytest.fixture(scope="module")
def narrow_server() -> Iterator[ServerThread]:
    """A server with a small replay buffer (30 kB: under one sentence of audio), one session at most, and a
    resume window (10 minutes) that outlasts any test, so a session that ends did not expire."""
    srv = ServerThread(Settings(replay_buffer_bytes=30_000, max_sessions=1, resume_window_s=600.0))
    yield srv
    srv.stop()


async def test_a_full_replay_buffer_pauses_a_waiting_session_which_keeps_its_place(
        narrow_server: ServerThread) -> None:
    """Past `replay_buffer_bytes` a waiting session stops taking its units' audio (their synthesis pauses,
    nothing is dropped) and the resume still gets all of it. Its replay buffer counts against the server's
    memory bound (`max_sessions` x `replay_buffer_bytes`): while it waits it keeps its place, so a new
    session is refused as on a full server."""
    srv = narrow_server
    reference = await _reference_of(srv, [LONG])
    async with Proxy(srv.port) as proxy:
        client = await _cut_mid_answer(srv, proxy)
        async with websockets.connect(srv.ws_url) as another:
            with pytest.raises(websockets.ConnectionClosed):
                await another.recv()
        assert another.close_code == 1013 and another.close_reason == "server full"
        _started, held, cap = await _until_units_ended(srv, client.session_id)
        biggest = max(len(i) for i in reference.items if isinstance(i, bytes))
        assert cap <= held <= cap + biggest, "the buffer filled to its cap and stopped (one frame over at most)"
        assert held < len(reference.audio()) // 2, "it stopped well before the answer's audio was all there"
        answer = await client.resume()  # a resume creates no session: the full server takes it
        assert answer["type"] == "session.resumed", answer
        assert await client.receive_until("session.done")
        _assert_same(client.got, reference)
        await _close(client, proxy)


async def test_the_python_client_acks_often_enough_for_a_small_replay_buffer(narrow_server: ServerThread) -> None:
    """A server whose `replay_buffer_bytes` (30 kB) is below the client's usual ack cadence (64 KiB): the
    client acks at a quarter of the published limit, so the server never stops for an ack and no send
    stalls. (Acking every 64 KiB, it did not ack an answer whose audio is between the two: the server waited
    for an ack to send `audio.done`, the send stalled, and every resume ended in the same stall.)"""
    async with client_connect(narrow_server.ws_url) as session:
        await session.configure(**CONFIG)
        await session.send_text("Hi.")
        await session.done()
        audio = await _audio_until_done(session)
        assert session.reconnects == 0
    assert narrow_server.settings.replay_buffer_bytes < len(audio) < ACK_EVERY_BYTES


async def test_a_resume_acknowledges_what_the_client_received(narrow_server: ServerThread) -> None:
    """A client that read a full replay buffer without acknowledging it (the server stopped sending) and
    lost its connection: its resume's `seq` acknowledges those frames, so the server forgets them and goes
    on; the answer arrives whole."""
    srv = narrow_server
    reference = await _reference_of(srv, [LONG])
    async with Proxy(srv.port) as proxy:
        client = ResumingClient(srv, proxy.url())
        await client.open()
        await _until_acknowledged(srv, client.session_id)
        await client.send({"type": "input.text", "text": LONG})
        await client.send({"type": "input.done"})
        assert client.ws is not None
        unacknowledged = 0
        while unacknowledged < srv.settings.replay_buffer_bytes:  # the server stops sending past this
            frame = await client.ws.recv()
            client.got.seq += 1
            client.got.items.append(frame if isinstance(frame, bytes) else json.loads(frame))
            unacknowledged += len(frame)
        proxy.abort()
        await _until_waiting(srv, client.session_id)
        answer = await client.resume()
        assert answer["type"] == "session.resumed", answer

        async def first_kept() -> int:
            return next(s for s in srv.ctx.sessions if s.session_id == client.session_id).replay.first_seq  # type: ignore[attr-defined]
        assert await _on_server(srv, first_kept) == client.got.seq + 1
        assert await client.receive_until("session.done")
        _assert_same(client.got, reference)
        await _close(client, proxy)


async def test_session_resume_on_a_plain_connection_is_refused_and_acks_past_the_end_are_errors(
        server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.resume", "session_id": "sess_000000", "token": "vwr_x", "seq": 0})
        got = await recv_until(ws, "error")
        assert got.events[-1]["code"] == "resume_not_allowed" and got.events[-1]["fatal"]
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, **CONFIG)
        await send(ws, {"type": "session.ack", "seq": 99})
        got = await recv_until(ws, "error")
        error = got.events[-1]
        assert error["code"] == "invalid_ack" and not error["fatal"] and error["seq"] == 2
        await send(ws, {"type": "input.text", "text": "Still usable."})
        await send(ws, {"type": "input.done"})
        done = await recv_until(ws, "session.done")
        assert done.events[-1]["input_seq"] == 3  # config, text, done: acks are not counted


# -- random cut points (property-based) ----------------------------------------------------------------

NEW_ANSWER = "A new answer."
_references: dict[tuple[int, tuple[str, ...]], Stream] = {}
_client_references: dict[tuple[int, tuple[str, ...]], tuple[bytes, list[Any], int]] = {}


async def _reference_of(server: ServerThread, deltas: list[str]) -> Stream:
    """`_reference`, once per server and text (hypothesis runs many examples against one)."""
    key = (server.port, tuple(deltas))
    if key not in _references:
        _references[key] = await _reference(server, deltas)
    return _references[key]


async def _until_acknowledged(server: ServerThread, session_id: str) -> None:
    """Until the server has the client's first `session.ack` (the session is resumable from then on)."""
    async def acknowledged() -> bool:
        return any(getattr(s, "session_id", None) == session_id and s.replay.acknowledged  # type: ignore[attr-defined]
                   for s in server.ctx.sessions)
    async with asyncio.timeout(30):
        while not await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(acknowledged(), server.loop)):
            await asyncio.sleep(0.01)


async def _drive(client: ResumingClient, proxy: Proxy, until: str, later_cuts: list[int]) -> int:
    """Receive until an event of type `until`, resuming (through the proxy) after every cut, and cutting
    again `later_cuts[i]` bytes into the i-th resumed connection's downstream. No cut is left pending when
    it returns. Returns the number of resumes."""
    resumes = 0
    reached = False
    while True:
        if not reached:
            reached = await client.receive_until(until)
        if reached:
            proxy.limits = {"down": None, "up": None}  # no cut after this point
        if proxy.cuts == resumes:
            assert reached, "the connection ended without a cut"
            return resumes
        # A cut: the rest comes on a resumed connection (also when `until` had arrived just before it).
        await _until_waiting(client.server, client.session_id)
        answer = await client.resume(base=proxy.url())
        assert answer["type"] == "session.resumed", answer
        assert answer["seq"] == client.got.seq, "the server counts exactly the frames this client received"
        resumes += 1
        if later_cuts and not reached:
            proxy.limits["down"] = proxy.passed["down"] + later_cuts.pop(0)


def _units(stream: Stream) -> list[tuple[dict[str, Any], bytes, dict[str, Any] | None]]:
    """Each unit of a stream: its `audio.start`, the audio received for it, its `audio.done` (None when
    missing)."""
    units: list[tuple[dict[str, Any], bytes, dict[str, Any] | None]] = []
    audio = b""
    start: dict[str, Any] | None = None
    for item in stream.items:
        if isinstance(item, bytes):
            assert start is not None, "audio outside a unit"
            audio += item
        elif item["type"] == "audio.start":
            assert start is None, "audio.start inside a unit"
            start, audio = item, b""
        elif item["type"] == "audio.done":
            assert start is not None and item["sentence_index"] == start["sentence_index"]
            units.append((start, audio, item))
            start = None
    if start is not None:
        units.append((start, audio, None))
    return units


def _assert_whole(stream: Stream) -> None:
    """What a resumed stream must be whatever happened: every frame numbered once, in order (`receive_until`
    checks each event's `seq` against the frames counted, so a lost or repeated binary frame fails there),
    every `audio.start` closed by its `audio.done`, whose `total_bytes` is exactly the audio received."""
    seqs = [i["seq"] for i in stream.items if isinstance(i, dict)]
    assert seqs == sorted(set(seqs))
    for start, audio, done in _units(stream):
        assert done is not None, f"audio.start without audio.done: {start}"
        assert done["total_bytes"] == len(audio), (start, done, len(audio))



@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(direction=st.sampled_from(["down", "up"]), at=st.floats(min_value=0.0, max_value=1.0),
       later=st.lists(st.floats(min_value=0.0, max_value=1.0), max_size=1))
async def test_cuts_at_random_points_lose_and_repeat_nothing(
        server: ServerThread, direction: str, at: float, later: list[float]) -> None:
    """A cut anywhere (before the first audio, mid-frame, between units, while the text is still being sent,
    during a replay): once resumed, the client has the audio of an uncut run byte for byte, the same events
    (word timestamps included), nothing twice, and the server keeps nothing of the session after it
    closes."""
    deltas = _deltas(TEXT)
    reference = await _reference_of(server, deltas)
    down_total = sum(len(i) if isinstance(i, bytes) else len(json.dumps(i)) for i in reference.items)
    up_total = 60 * (len(deltas) + 2)  # the text and input.done, with the acks between them
    async with Proxy(server.port) as proxy:
        client = ResumingClient(server, proxy.url())
        await client.open()
        await _until_acknowledged(server, client.session_id)
        total = down_total if direction == "down" else up_total
        proxy.limits[direction] = proxy.passed[direction] + 1 + int(at * total)
        for delta in deltas:
            await client.send({"type": "input.text", "text": delta})
            await asyncio.sleep(0)
        await client.send({"type": "input.done"})
        event(f"resumes: {await _drive(client, proxy, 'session.done', [1 + int(f * down_total) for f in later])}")
        _assert_whole(client.got)
        _assert_same(client.got, reference)
        await _close(client, proxy)  # on the resumed connection, which goes through the proxy


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(direction=st.sampled_from(["down", "up"]), at=st.floats(min_value=0.0, max_value=1.0),
       cancel_after=st.integers(min_value=1, max_value=len(_deltas(TEXT))))
async def test_cuts_around_a_cancel_apply_it_once_and_the_next_answer_plays_whole(
        server: ServerThread, direction: str, at: float, cancel_after: int) -> None:
    """The client cancels an answer part-way and starts another, and the connection is cut at a random
    point around it: the cancel is applied once (one `audio.cancelled`, no audio of the cancelled
    utterance after it), every unit started is closed, and the new answer is byte-identical to an uncut
    run of it alone."""
    deltas = _deltas(TEXT)
    fresh = await _reference_of(server, [NEW_ANSWER])
    async with Proxy(server.port) as proxy:
        client = ResumingClient(server, proxy.url())
        await client.open()
        await _until_acknowledged(server, client.session_id)
        total = 40_000 if direction == "down" else 60 * (cancel_after + 3)
        proxy.limits[direction] = proxy.passed[direction] + 1 + int(at * total)
        for delta in deltas[:cancel_after]:
            await client.send({"type": "input.text", "text": delta})
            await asyncio.sleep(0)
        await client.send({"type": "input.cancel"})
        await client.send({"type": "input.text", "text": NEW_ANSWER})
        await client.send({"type": "input.done"})
        event(f"resumes: {await _drive(client, proxy, 'session.done', [])}")
        await _close(client, proxy)  # on the resumed connection, which goes through the proxy
    _assert_whole(client.got)
    events = client.got.events()
    cancelled = [e for e in events if e["type"] == "audio.cancelled"]
    assert len(cancelled) == 1 and cancelled[0]["utterance_index"] == 0
    after = client.got.items[client.got.items.index(next(i for i in client.got.items if isinstance(i, dict)
                                                        and i["type"] == "audio.cancelled")):]
    assert not any(isinstance(i, dict) and i.get("utterance_index") == 0 and i["type"] != "audio.cancelled"
                   for i in after)
    answer = [(start, audio) for start, audio, _ in _units(client.got) if start["utterance_index"] == 1]
    assert b"".join(audio for _, audio in answer) == fresh.audio()
    words = [e["words"] for e in events if e["type"] == "audio.words" and e["utterance_index"] == 1]
    assert words == [e["words"] for e in fresh.events() if e["type"] == "audio.words"]



async def _client_run(server: ServerThread, url: str, deltas: list[str], proxy: Proxy | None = None,
                      direction: str = "down", cut: int = 0) -> tuple[bytes, list[Any], int]:
    """The Python client speaks `deltas` (through `proxy`, cut `cut` bytes into `direction` once the session
    is resumable): the audio and the word timings it yields, and how often it resumed."""
    async with client_connect(url) as session:
        updated = await session.configure(**CONFIG)
        if proxy is not None:
            await _until_acknowledged(server, updated.session_id)
            proxy.limits[direction] = proxy.passed[direction] + cut
        for delta in deltas:
            await session.send_text(delta)
        await session.done()
        audio, words = b"", []
        async for item in session:
            if isinstance(item, AudioData):
                audio += item.data
            elif isinstance(item, AudioWords):
                words.extend(item.words)
            elif isinstance(item, SessionDone):
                break
        if proxy is not None:
            proxy.limits = {"down": None, "up": None}
        return audio, words, session.reconnects


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(direction=st.sampled_from(["down", "up"]), at=st.floats(min_value=0.0, max_value=1.0))
async def test_the_python_client_resumes_from_cuts_at_random_points(
        server: ServerThread, direction: str, at: float) -> None:
    """The Python client through a connection cut at a random point (while it sends the text, or anywhere
    in the audio): it yields the audio of an uncut run byte for byte and the same word timings."""
    deltas = _deltas(TEXT)
    key = (server.port, ("client", *deltas))
    if key not in _client_references:
        _client_references[key] = await _client_run(server, server.ws_url, deltas)
    audio, words, _ = _client_references[key]
    total = len(audio) if direction == "down" else 60 * (len(deltas) + 2)
    async with Proxy(server.port) as proxy:
        got, got_words, reconnects = await _client_run(server, proxy.url(), deltas, proxy, direction,
                                                       1 + int(at * total))
        assert reconnects == proxy.cuts
        event(f"resumes: {reconnects}")
    assert got == audio
    assert got_words == words


@pytest.mark.parametrize("phase", ["dialling", "backing_off"])
async def test_closing_the_python_client_while_it_reconnects_ends_the_session_on_the_server(
        narrow_server: ServerThread, phase: str) -> None:
    """`close()` while the client is resuming a dropped connection (its new connection still opening, or
    between two attempts) still delivers `session.close`: the server ends the session now, rather than
    keeping it (and its replay log) for the whole resume window, and keeps nothing of it."""
    server = narrow_server
    async with Proxy(server.port) as proxy:
        session = await client_connect(proxy.url())
        updated = await session.configure(**CONFIG)
        runtime = await _runtime_ref(server, updated.session_id)
        await session.send_text("Hi.")
        await session.done()
        async for item in session:
            if isinstance(item, SessionDone):
                break
        await _until_acknowledged(server, updated.session_id)
        if phase == "dialling":
            proxy.admit.clear()
        else:
            proxy.refusing = True
        proxy.abort()
        async with asyncio.timeout(30):  # until the client is reconnecting (its new connection held, or refused)
            while proxy.held + proxy.refused == 0:
                await asyncio.sleep(0.01)
        closing = asyncio.create_task(session.close())
        await asyncio.sleep(0)  # close() has begun
        proxy.refusing = False
        proxy.admit.set()
        await closing
        assert session.closed
        await _assert_gone(server, updated.session_id, proxy.upstream_ports, runtime)
    ended = ResumingClient(server, server.ws_url)
    ended.session_id, ended.token = updated.session_id, updated.resume_token
    answer = await ended.resume()
    assert answer["code"] == "resume_expired" and "session.close" in answer["message"], answer


async def _scrape(server: ServerThread, key: str) -> dict[str, float]:
    """`GET /metrics` with API key `key`, parsed: every unlabelled sample by name."""
    async with httpx.AsyncClient(base_url=server.http_url, headers={"Authorization": f"Bearer {key}"}) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200, response.text
    return {s.name: s.value for family in text_string_to_metric_families(response.text) for s in family.samples
            if not s.labels}


async def test_every_refused_resume_leaves_a_session_in_progress_untouched() -> None:
    """While a bystander session (same API key) is in the middle of an answer, every kind of bad resume is
    tried on other sessions: a wrong token, a token of another key, an unknown session, a second resume
    (the first connection is taken over), a window that expired, a session ended with `session.close`.
    Each gets its own clear error, the bystander's answer is exactly that of an undisturbed run, and
    `/metrics` counts each attempt, success, expiry, replayed byte and waiting session."""
    srv = ServerThread(Settings(api_keys=("key-one", "key-two"), resume_window_s=3.0))
    one, two = "?token=key-one", "&token=key-one"
    try:
        reference = ResumingClient(srv, srv.ws_url + one)
        await reference.open()
        await reference.send({"type": "input.text", "text": LONG})
        await reference.send({"type": "input.done"})
        assert await reference.receive_until("session.done")
        assert reference.ws is not None
        await reference.ws.close()

        bystander = ResumingClient(srv, srv.ws_url + one)
        await bystander.open()
        await bystander.send({"type": "input.text", "text": LONG})
        await bystander.send({"type": "input.done"})
        assert await bystander.receive_until("audio.start")  # mid-answer from here on

        async with Proxy(srv.port) as proxy:
            # Dropped first, so that its window passes while the others are tried.
            expiring = ResumingClient(srv, proxy.url(one))
            limits = (await expiring.open())["limits"]
            assert limits["resume_window_s"] == 3.0
            assert limits["replay_buffer_bytes"] == srv.settings.replay_buffer_bytes
            await _until_acknowledged(srv, expiring.session_id)
            proxy.abort()
            await _until_waiting(srv, expiring.session_id)

            victim = ResumingClient(srv, proxy.url(one))
            await victim.open()
            await _until_acknowledged(srv, victim.session_id)
            proxy.abort()
            await _until_waiting(srv, victim.session_id)
            assert (await _scrape(srv, "key-one"))["voicewire_sessions_waiting_for_resume"] == 2
            wrong = await victim.resume(two, token="vwr_" + "A" * 43)
            assert wrong["code"] == "resume_denied" and "token does not match" in wrong["message"], wrong
            other_key = await victim.resume("&token=key-two")
            assert other_key["code"] == "resume_denied" and "another API key" in other_key["message"], other_key
            victim_id, victim.session_id = victim.session_id, "sess_999999"
            unknown = await victim.resume(two)
            assert unknown["code"] == "resume_unknown", unknown
            victim.session_id = victim_id
            resumed = [await victim.resume(two)]
            assert resumed[0]["type"] == "session.resumed", resumed
            first = victim.ws
            resumed.append(await victim.resume(two, close_old=False))
            assert resumed[1]["type"] == "session.resumed", resumed
            assert first is not None
            taken = json.loads(await first.recv())
            assert taken["code"] == "session_taken_over" and taken["fatal"], taken

            await _assert_gone(srv, expiring.session_id)  # the window passes
            expired = await expiring.resume(two)
            assert expired["code"] == "resume_expired" and "within 3 s" in expired["message"], expired

        closed = ResumingClient(srv, srv.ws_url + one)
        await closed.open()
        await _close(closed)
        after_close = await closed.resume(two)
        assert after_close["code"] == "resume_expired" and "session.close" in after_close["message"], after_close

        assert await bystander.receive_until("session.done")
        _assert_same(bystander.got, reference.got)
        metrics = await _scrape(srv, "key-one")
        assert metrics["voicewire_resumes_attempted_total"] == 7  # 3 refused, 2 resumed, expired, closed
        assert metrics["voicewire_resumes_succeeded_total"] == 2
        assert metrics["voicewire_resumes_expired_total"] == 1  # session.close is no expiry
        assert metrics["voicewire_replayed_bytes_total"] == sum(r["replay_bytes"] for r in resumed)
        assert metrics["voicewire_sessions_waiting_for_resume"] == 0
        await _close(bystander)
        await _close(victim)
    finally:
        srv.stop()
