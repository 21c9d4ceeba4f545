"""Access control on a real server: API keys (header and query), origins, rotation, per-key limits."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets
from voicewire.realtime.auth import KeyRing
from voicewire.realtime.settings import Settings
from websockets.typing import Origin

from tests.server import ServerThread
from tests.wsclient import configure

KEY = "vw-test-key-0123456789"


def http(url: str, key: str | None = None) -> tuple[int, dict[str, object], dict[str, str]]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body.startswith(b"{") else {}, dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


@pytest.fixture(scope="module")
def secured() -> Iterator[ServerThread]:
    srv = ServerThread(Settings(api_keys=(KEY,), allowed_origins=("https://app.example",), max_sessions_per_key=2,
                                rest_requests_per_minute=60, rest_burst=3))
    yield srv
    srv.stop()


@pytest.mark.parametrize(("headers", "query"), [({}, ""), ({"Authorization": "Bearer wrong"}, ""), ({}, "?token=wrong"),
                                               ({"Authorization": f"Basic {KEY}"}, "")])
async def test_websocket_without_a_valid_key_is_refused_before_the_upgrade(
        secured: ServerThread, headers: dict[str, str], query: str) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(secured.ws_url + query, additional_headers=headers):
            pass
    assert refused.value.response.status_code == 401
    body = json.loads(refused.value.response.body or b"{}")
    assert body["error"]["code"] in {"missing_api_key", "invalid_api_key"}


@pytest.mark.parametrize("how", ["header", "query"])
async def test_websocket_with_the_key_in_header_or_query_works(secured: ServerThread, how: str) -> None:
    url = secured.ws_url + (f"?token={KEY}" if how == "query" else "")
    headers = {"Authorization": f"Bearer {KEY}"} if how == "header" else {}
    async with websockets.connect(url, additional_headers=headers) as ws:
        updated = await configure(ws)
    assert updated["engine"]["name"] == "hibari"


async def test_browser_origins_are_checked(secured: ServerThread) -> None:
    good = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(secured.ws_url, additional_headers=good, origin=Origin("https://evil.example")):
            pass
    assert refused.value.response.status_code == 403
    for origin in ("https://app.example", secured.http_url):
        async with websockets.connect(secured.ws_url, additional_headers=good, origin=Origin(origin)) as ws:
            await configure(ws)


def test_rest_needs_the_key_and_open_paths_stay_open(secured: ServerThread) -> None:
    assert http(f"{secured.http_url}/health")[0] == 200
    assert http(f"{secured.http_url}/ready")[0] == 200
    status, body, headers = http(f"{secured.http_url}/v1/models")
    assert status == 401 and body["error"]["code"] == "missing_api_key"  # type: ignore[index]
    assert headers.get("WWW-Authenticate") == "Bearer"
    assert http(f"{secured.http_url}/v1/models", "nope")[0] == 401
    assert http(f"{secured.http_url}/metrics")[0] == 401


def test_rest_rate_limit_answers_429_with_retry_after(secured: ServerThread) -> None:
    statuses = [http(f"{secured.http_url}/v1/models", KEY) for _ in range(6)]
    codes = [s for s, _, _ in statuses]
    assert 200 in codes and codes[-1] == 429
    _, body, headers = statuses[-1]
    assert body["error"]["code"] == "rate_limited" and int(headers["Retry-After"]) >= 1  # type: ignore[index]


async def test_per_key_session_cap(secured: ServerThread) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with websockets.connect(secured.ws_url, additional_headers=headers) as a, \
            websockets.connect(secured.ws_url, additional_headers=headers) as b:
        await configure(a)
        await configure(b)
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(secured.ws_url, additional_headers=headers):
                pass
        assert refused.value.response.status_code == 429
    # Closing frees the slots.
    async with websockets.connect(secured.ws_url, additional_headers=headers) as c:
        await configure(c)


async def test_keys_rotate_from_the_key_file_without_a_restart(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# rotated monthly\nold-key-1\n")
    srv = ServerThread(Settings(api_keys_file=keyfile))
    try:
        async with websockets.connect(srv.ws_url + "?token=old-key-1") as ws:
            await configure(ws)
        keyfile.write_text("new-key-2\n")
        async with asyncio.timeout(30):
            while http(f"{srv.http_url}/v1/models", "new-key-2")[0] != 200:
                await asyncio.sleep(0.2)
        assert http(f"{srv.http_url}/v1/models", "old-key-1")[0] == 401
    finally:
        srv.stop()


def test_keys_are_never_logged(secured: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    http(f"{secured.http_url}/v1/models", "leaky-secret-value")
    http(f"{secured.http_url}/v1/models", KEY)
    assert "leaky-secret-value" not in caplog.text and KEY not in caplog.text


def test_a_server_without_keys_refuses_to_start_unless_told_to_run_open() -> None:
    from voicewire.realtime.app import create_app

    with pytest.raises(ValueError, match="no API keys configured"):
        create_app(Settings())


def test_keyring_matches_only_configured_keys() -> None:
    ring = KeyRing(("a-key",), None)
    assert ring.match("a-key") is not None and ring.match("a-kez") is None and ring.match("") is None
    assert ring.match("a-key") == ring.match("a-key") != "a-key"


async def test_per_ip_limits_use_the_address_the_proxy_appended() -> None:
    srv = ServerThread(Settings(api_keys=(KEY,), trust_forwarded_for=True, max_sessions_per_ip=1))
    try:
        def headers(forwarded: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {KEY}", "X-Forwarded-For": forwarded}

        async with websockets.connect(srv.ws_url, additional_headers=headers("1.1.1.1, 203.0.113.7")) as ws:
            await configure(ws)
            # A client-chosen first entry does not make it a new address: the proxy saw 203.0.113.7.
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(srv.ws_url, additional_headers=headers("2.2.2.2, 203.0.113.7")):
                    pass
            assert refused.value.response.status_code == 429
            async with websockets.connect(srv.ws_url, additional_headers=headers("203.0.113.8")) as other:
                await configure(other)
    finally:
        srv.stop()
