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


KEY = "vw-lifecycle-key-0123456789"


@pytest.fixture(params=[("--no-auth",)])
def process(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voicewire.realtime", "--port", str(port), *request.param],
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

    sentences = " ".join(f"Sentence number {n} of this long reply is here." for n in range(8))
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream") as ws:
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
        await send(ws, {"type": "input.text", "text": sentences})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "audio.start")
        proc.send_signal(signal.SIGTERM)
        # Draining: the listener stays open and says "not ready", so a balancer sees a 503, not a refusal.
        assert get(f"{base}/ready")[0] == 503
        assert get(f"{base}/health")[0] == 200
        got = await recv_until(ws, "session.done", got)
        assert got.of("session.done")[0]["total_sentences"] == 8, "the open utterance is finished"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    assert proc.wait(30) == 0
    output = proc.stdout.read().decode() if proc.stdout else ""
    assert "engine hibari ready" in output


@pytest.mark.parametrize("process", [("--api-key", KEY)], indirect=True)
async def test_sighup_without_a_key_file_keeps_serving_and_query_tokens_stay_out_of_the_log(
        process: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = process
    base = f"http://127.0.0.1:{port}"
    await wait_until(lambda: get(f"{base}/ready")[0] == 200, "ready")
    proc.send_signal(signal.SIGHUP)
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream?token={KEY}") as ws:
        await configure(ws)
    assert proc.poll() is None, "SIGHUP stopped the server"
    assert get(f"{base}/health")[0] == 200
    # Refused requests are logged at once, token and all (a wrong key may be another server's key).
    with pytest.raises(websockets.InvalidStatus):
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream?token=other-{KEY}"):
            pass
    assert get(f"{base}/v1/models?token={KEY}")[0] == 401
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    output = proc.stdout.read().decode() if proc.stdout else ""
    assert "nothing to reload" in output
    assert '"GET /v1/audio/speech/stream?token=REDACTED HTTP/1.1" 401' in output
    assert '"GET /v1/models?token=REDACTED HTTP/1.1" 401' in output
    assert KEY not in output
