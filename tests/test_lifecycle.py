"""The server as a user runs it: `python -m voicewire.realtime`, health, readiness, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import websockets

from tests.server import free_port
from tests.wsclient import configure, recv_until, send


def get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def process() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voicewire.realtime", "--port", str(port), "--no-auth"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def wait_until(predicate: object, what: str) -> None:
    async with asyncio.timeout(120):
        while True:
            try:
                if predicate():  # type: ignore[operator]
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            await asyncio.sleep(0.1)


async def test_health_then_ready_then_sigterm_finishes_sessions_and_exits_0(
        process: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = process
    base = f"http://127.0.0.1:{port}"
    await wait_until(lambda: get(f"{base}/health")[0] == 200, "health")
    await wait_until(lambda: get(f"{base}/ready")[0] == 200, "ready")
    _, body = get(f"{base}/ready")
    assert body["engine"] == "hibari"

    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream") as ws:
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
        await send(ws, {"type": "input.text", "text": "One. Two is here. Three comes last."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "audio.start")
        proc.send_signal(signal.SIGTERM)
        got = await recv_until(ws, "session.done", got)
        assert got.of("session.done")[0]["total_sentences"] == 3, "the open utterance is finished"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    assert proc.wait(30) == 0
    output = proc.stdout.read().decode() if proc.stdout else ""
    assert "engine hibari ready" in output
