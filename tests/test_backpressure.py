"""A client that stops reading pauses its own synthesis, never slows others, and is closed when stalled."""

from __future__ import annotations

import asyncio
import socket

import websockets
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

SENTENCES = 60
TEXT = " ".join(f"Sentence number {n} is part of a very long answer nobody reads." for n in range(SENTENCES))


def tiny_receive_buffer_socket(port: int) -> socket.socket:
    """A client socket whose kernel receive buffer is as small as the OS allows."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


async def test_a_client_that_stops_reading_pauses_its_synthesis_and_others_keep_flowing() -> None:
    srv = ServerThread(Settings(stall_timeout_s=600.0))
    try:
        sock = tiny_receive_buffer_socket(srv.port)
        async with websockets.connect(srv.ws_url, sock=sock, max_queue=1, max_size=None) as lazy:
            await configure(lazy, split_granularity="sentence", response_format="pcm", stream_audio=True,
                            sample_rate=48000)
            await send(lazy, {"type": "input.text", "text": TEXT})
            await send(lazy, {"type": "input.done"})
            # Meanwhile another session speaks normally, start to finish.
            async with websockets.connect(srv.ws_url) as busy:
                await configure(busy, split_granularity="sentence", response_format="pcm", stream_audio=True)
                for n in range(3):
                    await send(busy, {"type": "input.text", "text": f"Other session, turn {n}. Still fine."})
                    await send(busy, {"type": "input.done"})
                    got = await recv_until(busy, "session.done")
                    assert got.of("session.done")[0]["total_sentences"] == 2
            # The lazy session's synthesis stalled at its in-flight cap once its socket filled up.
            started = await _settled_engine_requests(srv, "sess_000000")
            assert started < SENTENCES // 2, started
            # Reading again resumes synthesis: every unit arrives, in order.
            got = await recv_until(lazy, "session.done", timeout=300)
            indices = [e["sentence_index"] for e in got.of("audio.done")]
            assert indices == list(range(SENTENCES))
    finally:
        srv.stop()


async def _settled_engine_requests(srv: ServerThread, session_id: str) -> int:
    """Engine requests the session has started, once that number stops changing."""

    async def count() -> int:
        session = next(s for s in srv.ctx.sessions if getattr(s, "session_id", None) == session_id)
        return int(session.engine_requests_started)  # type: ignore[attr-defined]

    last = -1
    while True:
        await asyncio.sleep(0.5)
        now = srv.call(count)
        if now == last:
            return now
        last = now


async def test_a_stalled_client_is_closed_with_1008() -> None:
    srv = ServerThread(Settings(stall_timeout_s=1.0))
    try:
        sock = tiny_receive_buffer_socket(srv.port)
        lazy = await websockets.connect(srv.ws_url, sock=sock, max_queue=1, max_size=None, ping_interval=None)
        await configure(lazy, split_granularity="sentence", response_format="pcm", stream_audio=True,
                        sample_rate=48000)
        await send(lazy, {"type": "input.text", "text": TEXT})
        await send(lazy, {"type": "input.done"})

        async def closed_sessions() -> int:
            return len(srv.ctx.sessions)

        async with asyncio.timeout(120):
            while srv.call(closed_sessions):
                await asyncio.sleep(0.2)
        codes = []
        try:
            async with asyncio.timeout(60):
                while True:
                    await lazy.recv()
        except websockets.ConnectionClosed as closed:
            codes.append(closed.rcvd.code if closed.rcvd else None)
        assert codes == [1008], codes
        await lazy.close()
    finally:
        srv.stop()
