"""Hostile references: the server never fetches a URL a client names (no SSRF), over REST or WebSocket."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
import websockets
from aiohttp import web

from tests.server import ServerThread, free_port
from tests.wsclient import recv_until

TARGETS = ("http://127.0.0.1:{port}/secret", "http://localhost:{port}/secret", "http://169.254.169.254/latest",
           "http://[::1]:{port}/secret", "http://10.0.0.1/internal", "file:///etc/passwd", "ftp://127.0.0.1/x")


@pytest.fixture
async def canary() -> AsyncIterator[tuple[int, list[str]]]:
    """A loopback HTTP server that records every request it gets: nobody should call it."""
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(body=b"RIFF")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port, hits
    await runner.cleanup()


@pytest.mark.parametrize("target", TARGETS)
async def test_ref_audio_urls_are_refused_and_never_fetched(server: ServerThread, canary: tuple[int, list[str]],
                                                            target: str) -> None:
    port, hits = canary
    url = target.format(port=port)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.http_url}/v1/audio/speech", json={
                "input": "Hello.", "voice": "alloy", "ref_audio": url, "task_type": "Base"}) as resp:
            body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] in {"ref_audio", "task_type"}
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "session.config", "ref_audio": url}))
        error = (await recv_until(ws, "error")).of("error")[0]
    assert error["code"] == "invalid_config" and error["param"] == "ref_audio"
    assert hits == [], "the server fetched a client-named URL"


async def test_oversized_base64_reference_audio_is_refused_before_decoding(server: ServerThread) -> None:
    huge = "data:audio/wav;base64," + "A" * (5 * 1024 * 1024)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.http_url}/v1/audio/speech",
                             json={"input": "Hello.", "ref_audio": huge}) as resp:
            body = await resp.json()
    assert resp.status == 413 and body["error"]["code"] == "payload_too_large"
