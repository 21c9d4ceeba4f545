"""Clients that send a request slowly, over raw sockets: deadlines on heads and bodies, per-address caps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from voicewire.realtime.settings import Settings

from tests.server import Loopback, ServerProcess, ServerThread

SPEECH_HEAD = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 100000\r\n\r\n")


@pytest.fixture(scope="module")
def impatient() -> Iterator[ServerThread]:
    srv = ServerThread(Settings(header_timeout_s=1.0, body_timeout_s=2.0, max_bodies_per_ip=2))
    yield srv
    srv.stop()


class Trickler:
    """One raw connection that sends `head`, then one byte every 0.1 s until the server answers or closes."""

    def __init__(self, port: int, head: bytes) -> None:
        self.port = port
        self.head = head
        self.started = asyncio.Event()

    async def run(self) -> bytes:
        """Everything the server sent before it closed the connection."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(self.head)
            self.started.set()
            async with asyncio.timeout(60):
                while True:
                    try:
                        first = await asyncio.wait_for(reader.read(65536), 0.1)
                    except TimeoutError:
                        writer.write(b" ")
                        continue
                    return first + await reader.read() if first else b""
        except ConnectionError:
            return b""
        finally:
            writer.close()


async def status_of(srv: Loopback, path: str) -> int:
    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(srv.http_url + path)).status_code


def answer(raw: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


async def test_a_body_sent_a_byte_at_a_time_gets_408_and_its_connection_closed(impatient: ServerThread) -> None:
    status, headers, body = answer(await Trickler(impatient.port, SPEECH_HEAD).run())
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout"  # type: ignore[index]
    assert await status_of(impatient, "/health") == 200


async def test_slow_bodies_count_against_the_address_and_one_too_many_is_refused_at_once(
        impatient: ServerThread) -> None:
    slow = [Trickler(impatient.port, SPEECH_HEAD) for _ in range(2)]
    tasks = [asyncio.create_task(t.run()) for t in slow]
    for t in slow:
        await t.started.wait()
    await status_of(impatient, "/health")  # by its answer, the server has read both heads
    refused: list[int] = []
    async with asyncio.timeout(60):
        while not refused and not any(task.done() for task in tasks):
            # The two slow ones hold the address's places while their bodies trickle in.
            status, headers, body = answer(await Trickler(impatient.port, SPEECH_HEAD).run())
            if status == 429:
                assert headers["retry-after"] == "1"
                assert body["error"]["code"] == "too_many_bodies"  # type: ignore[index]
                refused.append(status)
    assert refused, "a third slow body from the same address was accepted"
    assert [answer(raw)[0] for raw in await asyncio.gather(*tasks)] == [408, 408]
    # Their places are free again: a whole body goes through.
    async with httpx.AsyncClient(timeout=60) as client:
        speech = await client.post(f"{impatient.http_url}/v1/audio/speech",
                                   json={"input": "Fine.", "voice": "alloy", "response_format": "pcm"})
    assert speech.status_code == 200 and speech.content


async def test_a_request_head_sent_a_byte_at_a_time_is_cut_off(impatient: ServerThread) -> None:
    raw = await Trickler(impatient.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").run()
    assert raw == b"", "no answer: the connection is closed"
    assert await status_of(impatient, "/health") == 200


SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


async def test_slow_heads_count_against_the_address_and_one_too_many_is_refused_at_once(
        impatient: ServerThread) -> None:
    slow = [Trickler(impatient.port, SLOW_HEAD) for _ in range(2)]
    tasks = [asyncio.create_task(t.run()) for t in slow]
    for t in slow:
        await t.started.wait()
    # A request whose head arrives whole is never counted, so never refused.
    assert await status_of(impatient, "/health") == 200
    refused: list[int] = []
    async with asyncio.timeout(60):
        while not refused and not any(task.done() for task in tasks):
            # The two slow heads hold the address's places while they trickle in.
            raw = await Trickler(impatient.port, SLOW_HEAD).run()
            if raw:
                status, headers, body = answer(raw)
                assert status == 429 and headers["retry-after"] == "1" and headers["connection"] == "close"
                assert body["error"]["code"] == "too_many_bodies"  # type: ignore[index]
                refused.append(status)
    assert refused, "a third slow head from the same address was accepted"
    assert await asyncio.gather(*tasks) == [b"", b""], "cut off at the header deadline, unanswered"
    # Their places are free again: a slow body is taken (and times out) rather than refused.
    status, _, body = answer(await Trickler(impatient.port, SPEECH_HEAD).run())
    assert status == 408, body


async def test_voicewire_serve_counts_slow_heads_too(tmp_path: Path) -> None:
    """The served process (its own listener, uvloop) with the default cap: `max_bodies_per_ip` slow heads
    hold the address's places, one more is refused at once, and whole requests still pass."""
    srv = ServerProcess(tmp_path / "server.log", "--no-auth")
    writers: list[asyncio.StreamWriter] = []
    try:
        async with asyncio.timeout(120):
            while True:
                try:
                    await status_of(srv, "/health")
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            for _ in range(Settings().max_bodies_per_ip):
                _, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                writer.write(SLOW_HEAD)
                writers.append(writer)
            assert await status_of(srv, "/health") == 200
            while True:  # until the server has read the slow heads (they stay for header_timeout_s)
                reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                writer.write(SLOW_HEAD)
                try:
                    raw = await asyncio.wait_for(reader.read(), 1.0)
                    break
                except TimeoutError:
                    writer.close()
            writer.close()
            status, headers, body = answer(raw)
        assert status == 429 and headers["retry-after"] == "1"
        assert body["error"]["code"] == "too_many_bodies"  # type: ignore[index]
        assert srv.proc.poll() is None
    finally:
        for writer in writers:
            writer.close()
        srv.stop()
