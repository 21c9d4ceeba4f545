"""Every HTTP response carries `x-request-id`, as OpenAI's API does (LiveKit's OpenAI plugin warns without
it; the `openai` SDK exposes it as `request_id`): a sane id the client sent comes back, anything else is
replaced by a fresh one."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import websockets

from tests.server import ServerThread

GENERATED = re.compile(r"req_[0-9a-f]{32}")


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("GET", "/health", None, 200),
    ("GET", "/ready", None, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", "/", None, 200),
    ("GET", "/clients/voicewire.js", None, 200),
    ("GET", "/no/such/route", None, 404),
    ("POST", "/v1/audio/speech", {"input": "Hi.", "response_format": "pcm"}, 200),
    ("POST", "/v1/audio/speech", {"input": "Hi.", "speed": 9}, 400),
    ("POST", "/v1/audio/speech", {"input": "Hi.", "response_format": "wav", "stream": False}, 200),
])
def test_every_response_has_a_request_id_and_a_sane_one_is_echoed(
        server: ServerThread, method: str, path: str, body: object, status: int) -> None:
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        fresh = http.request(method, path, json=body)
        echoed = http.request(method, path, json=body, headers={"X-Request-Id": "trace-42.a:b_c"})
    assert fresh.status_code == echoed.status_code == status
    assert GENERATED.fullmatch(fresh.headers["x-request-id"])
    assert echoed.headers["x-request-id"] == "trace-42.a:b_c"


@pytest.mark.parametrize("sent", ["", "a" * 129, "two words", "<script>", "id;drop"])
def test_an_unsafe_client_id_is_replaced(server: ServerThread, sent: str) -> None:
    response = httpx.get(f"{server.http_url}/v1/models", headers={"X-Request-Id": sent})
    assert GENERATED.fullmatch(response.headers["x-request-id"])


def test_ids_differ_per_request(server: ServerThread) -> None:
    ids = {httpx.get(f"{server.http_url}/health").headers["x-request-id"] for _ in range(5)}
    assert len(ids) == 5


def test_the_openai_sdk_sees_the_request_id(server: ServerThread) -> None:
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="not-needed", max_retries=0) as client:
        response = client.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input="Hello.")
    assert response.request_id is not None and GENERATED.fullmatch(response.request_id)


async def test_the_websocket_upgrade_carries_the_request_id(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url, additional_headers={"X-Request-Id": "ws-7"}) as ws:
        assert ws.response is not None and ws.response.headers["x-request-id"] == "ws-7"
