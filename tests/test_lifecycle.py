"""The server as a user runs it: `python -m voicewire.realtime`, health, readiness, SIGTERM."""

from __future__ import annotations

import argparse
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
from voicewire.realtime.cli import build_parser

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


async def closed_code(ws: websockets.ClientConnection) -> int | None:
    """Read until the server closes; the close code it sent."""
    with pytest.raises(websockets.ConnectionClosed) as closed:
        async with asyncio.timeout(60):
            while True:
                await ws.recv()
    return None if closed.value.rcvd is None else closed.value.rcvd.code


async def test_a_drain_closes_settled_sessions_at_once_and_finishes_an_utterance_whose_text_is_still_arriving(
        process: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = process
    base = f"http://127.0.0.1:{port}"
    url = f"ws://127.0.0.1:{port}/v1/audio/speech/stream"
    await wait_until(lambda: get(f"{base}/ready")[0] == 200, "ready")
    async with websockets.connect(url) as idle, websockets.connect(url) as talking:
        await configure(idle)
        await configure(talking, split_granularity="sentence", response_format="pcm")
        # An LLM streaming its reply: the first sentence is spoken, the second is still arriving.
        await send(talking, {"type": "input.text", "text": "The first sentence is here. And the sec"})
        got = await recv_until(talking, "audio.done")
        proc.send_signal(signal.SIGTERM)
        assert await closed_code(idle) == 1001, "a session with nothing in progress is closed at once"
        await send(talking, {"type": "input.text", "text": "ond one ends here."})
        await send(talking, {"type": "input.done"})
        got = await recv_until(talking, "session.done", got)
        assert [e["sentence_text"] for e in got.of("audio.start")] == [
            "The first sentence is here.", "And the second one ends here."]
        assert got.of("session.done")[0]["total_sentences"] == 2
        assert await closed_code(talking) == 1001
    assert proc.wait(30) == 0


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


async def test_serve_says_where_it_listens_and_keeps_probes_out_of_the_info_log(
        process: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = process
    base = f"http://127.0.0.1:{port}"
    await wait_until(lambda: get(f"{base}/ready")[0] == 200, "ready")
    for _ in range(5):
        assert get(f"{base}/health")[0] == 200
    assert get(f"{base}/v1/models")[0] == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    lines = (proc.stdout.read().decode() if proc.stdout else "").splitlines()
    assert any(line.endswith(f"voicewire: listening on http://127.0.0.1:{port} (demo: /)") for line in lines), lines
    assert any("GET /v1/models" in line for line in lines), "real requests stay in the access log"
    probes = [line for line in lines if "GET /health" in line or "GET /ready" in line]
    assert probes == [], "health and readiness probes are not logged at INFO"


@pytest.mark.parametrize("process", [("--api-key", KEY, "--log-level", "debug")], indirect=True)
async def test_probes_are_logged_at_debug_with_tokens_redacted(process: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = process
    base = f"http://127.0.0.1:{port}"
    await wait_until(lambda: get(f"{base}/ready")[0] == 200, "ready")
    assert get(f"{base}/health?token={KEY}")[0] == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    output = proc.stdout.read().decode() if proc.stdout else ""
    probes = [line for line in output.splitlines() if "GET /health" in line]
    assert probes and all(" DEBUG " in line for line in probes), probes
    assert any('"GET /health?token=REDACTED HTTP/1.1" 200' in line for line in probes), probes
    assert KEY not in output


def test_every_serve_flag_has_help() -> None:
    serve = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    flags = [action for action in serve.choices["serve"]._actions if action.option_strings]
    assert {"--host", "--port", "--max-sessions", "--log-level"} <= {f for a in flags for f in a.option_strings}
    missing = [action.option_strings[0] for action in flags if not action.help]
    assert missing == []


def test_a_server_id_that_cannot_prefix_a_session_id_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    from voicewire.realtime.cli import main

    assert main(["serve", "--server-id", "a.b", "--no-auth"]) == 2
    assert "server id 'a.b': use 1-64 letters, digits, '_' or '-'" in capsys.readouterr().err
