"""Access control on a real server: API keys (header and query), origins, rotation and revocation,
per-key limits, the Referer policy."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import websockets
from voicewire.adapters.registry import create_engine
from voicewire.realtime.auth import KeyRing
from voicewire.realtime.settings import Settings
from websockets.typing import Origin

from tests.faults import PacedEngine
from tests.server import Loopback, ServerProcess, ServerThread
from tests.wsclient import configure, recv_until, send, utter

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
    deadline = time.monotonic() + 10
    while caplog.text.count("/v1/models") < 2 and time.monotonic() < deadline:  # the access log is written
        time.sleep(0.05)                                                       # after the response
    assert caplog.text.count("/v1/models") >= 2, caplog.text  # both requests were logged, so this checks them
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


async def test_dns_rebinding_origin_is_refused_whatever_the_host_header_says(secured: ServerThread) -> None:
    """A page on evil.example whose name was rebound to 127.0.0.1 sends `Host` and `Origin` that agree;
    the server's own origin is judged by the address and port the connection reached, not by `Host`."""
    port = secured.port
    headers = {"Authorization": f"Bearer {KEY}", "Host": f"evil.example:{port}",
               "Origin": f"http://evil.example:{port}"}
    async with aiohttp.ClientSession() as http_session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with http_session.ws_connect(secured.ws_url, headers=headers):
                pass
        assert refused.value.status == 403
        for own in (f"http://localhost:{port}", f"http://127.0.0.1:{port}"):
            own_headers = {**headers, "Host": own.removeprefix("http://"), "Origin": own}
            async with http_session.ws_connect(secured.ws_url, headers=own_headers) as ws:
                await ws.send_json({"type": "session.config"})
                assert (await ws.receive_json())["type"] == "session.updated"


def test_pages_and_assets_keep_the_token_out_of_the_referer(secured: ServerThread) -> None:
    for path in ("/", "/clients/voicewire.js", "/health"):
        with urllib.request.urlopen(f"{secured.http_url}{path}?token={KEY}", timeout=10) as resp:
            assert resp.headers["Referrer-Policy"] == "no-referrer", path


@pytest.mark.parametrize("name", ["token", "Token", "TOKEN", "%74oken", "t%6Fk%65n"])
def test_the_access_log_redacts_a_token_in_the_request_line_and_the_referer_however_it_is_spelled(
        secured: ServerThread, caplog: pytest.LogCaptureFixture, name: str) -> None:
    """The access line of a request whose URL and `Referer` carry the key as a query parameter, spelled in
    any case or percent-encoded, names the parameter with `REDACTED` in both places and holds no key."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    referer = f"http://127.0.0.1:{secured.port}/?{name}={KEY}&lang=en"
    request = urllib.request.Request(f"{secured.http_url}/v1/models?{name}={KEY}&page=2",
                                     headers={"Referer": referer})
    with pytest.raises(urllib.error.HTTPError) as refused:  # REST takes keys from the header only
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401

    def access_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "aiohttp.access" and "page=2" in r.getMessage()]

    for _ in range(1000):  # aiohttp writes the line once the response is sent (a hang guard, not a measure)
        if access_lines():
            break
        time.sleep(0.01)
    (line,) = access_lines()
    assert KEY not in caplog.text
    assert line.count("=REDACTED") == 2 and "page=2" in line and "lang=en" in line, line


def metric(srv: Loopback, name: str, key: str) -> float:
    with urllib.request.urlopen(urllib.request.Request(f"{srv.http_url}/metrics", headers={
            "Authorization": f"Bearer {key}"}), timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_a_missing_key_file_keeps_the_last_good_keys_loudly(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("file-key-1\n")
    srv = ServerThread(Settings(api_keys=("static-key",), api_keys_file=keyfile))
    try:
        keyfile.unlink()
        async with asyncio.timeout(30):
            while metric(srv, "voicewire_api_keys_stale", "static-key") != 1:
                await asyncio.sleep(0.2)
        assert metric(srv, "voicewire_api_key_reload_failures_total", "static-key") >= 1
        assert "cannot read API key file" in caplog.text
        assert http(f"{srv.http_url}/v1/models", "file-key-1")[0] == 200, "the last good keys stay in force"
        keyfile.write_text("file-key-2\n")
        async with asyncio.timeout(30):
            while http(f"{srv.http_url}/v1/models", "file-key-2")[0] != 200:
                await asyncio.sleep(0.2)
        assert metric(srv, "voicewire_api_keys_stale", "static-key") == 0
        assert http(f"{srv.http_url}/v1/models", "file-key-1")[0] == 401
    finally:
        srv.stop()


async def eventually(check: Callable[[], bool], timeout: float = 120.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            try:
                if check():
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            await asyncio.sleep(0.1)


async def test_sighup_after_the_key_file_is_deleted_keeps_the_old_keys_loudly_and_keeps_serving(
        tmp_path: Path) -> None:
    """Issue 14 #8 exactly: delete the key file, then SIGHUP the real server process."""
    keyfile = tmp_path / "keys"
    keyfile.write_text("file-key-1\n")
    srv = ServerProcess(tmp_path / "server.log", "--api-keys-file", str(keyfile))
    failed_read = f"cannot read API key file {keyfile}"
    try:
        await eventually(lambda: http(f"{srv.http_url}/ready")[0] == 200)
        async with websockets.connect(srv.ws_url, additional_headers={"Authorization": "Bearer file-key-1"}) as ws:
            await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
            keyfile.unlink()
            srv.proc.send_signal(signal.SIGHUP)
            await eventually(lambda: srv.lines(failed_read) >= 1)
            # Every SIGHUP says it again (the file watcher says it once), at ERROR.
            before = srv.lines(failed_read)
            srv.proc.send_signal(signal.SIGHUP)
            await eventually(lambda: srv.lines(failed_read) > before)
            assert all(" ERROR " in line for line in srv.log.read_text().splitlines() if failed_read in line)
            assert metric(srv, "voicewire_api_keys_stale", "file-key-1") == 1
            assert metric(srv, "voicewire_api_key_reload_failures_total", "file-key-1") >= 2
            assert srv.proc.poll() is None, "SIGHUP stopped the server"
            # The last good keys stay in force: the open session speaks, and new requests and sessions pass.
            done = await utter(ws, "Still speaking after the reload.")
            assert done.of("session.done") and not done.of("error")
            assert any(isinstance(item, bytes) for item in done.items)
        assert http(f"{srv.http_url}/v1/models", "file-key-1")[0] == 200
        assert http(f"{srv.http_url}/v1/models", "another-key")[0] == 401
        async with websockets.connect(srv.ws_url + "?token=file-key-1") as again:
            await configure(again)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()


def test_a_server_whose_key_file_cannot_be_read_refuses_to_start(tmp_path: Path) -> None:
    from voicewire.realtime.app import create_app

    with pytest.raises(ValueError, match="cannot read the API key file"):
        create_app(Settings(api_keys_file=tmp_path / "missing"))


async def test_a_revoked_keys_sessions_finish_their_utterance_then_close_with_1008(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("doomed-key\nkept-key\n")
    srv = ServerThread(Settings(api_keys_file=keyfile, engine_workers=1),
                       PacedEngine(create_engine("hibari", workers=1), speed=1.0))
    text = "The first sentence is here. A second one follows it. The third one ends this utterance."
    try:
        async with websockets.connect(srv.ws_url + "?token=doomed-key") as speaking, \
                websockets.connect(srv.ws_url + "?token=doomed-key") as idle, \
                websockets.connect(srv.ws_url + "?token=kept-key") as bystander:
            for ws in (speaking, idle, bystander):
                await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
            await send(speaking, {"type": "input.text", "text": text})
            await send(speaking, {"type": "input.done"})
            got = await recv_until(speaking, "audio.start")
            keyfile.write_text("kept-key\n")
            got = await recv_until(speaking, "session.done", got)
            assert got.of("session.done")[0]["total_sentences"] == 3 and not got.of("error")
            for ws in (speaking, idle):
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    async with asyncio.timeout(60):
                        while True:
                            await ws.recv()
                assert closed.value.rcvd is not None
                assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1008, "api key revoked")
            await send(bystander, {"type": "input.text", "text": "Still here."})
            await send(bystander, {"type": "input.done"})
            assert (await recv_until(bystander, "session.done")).of("session.done")
        assert metric(srv, "voicewire_sessions_revoked_total", "kept-key") == 2
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(srv.ws_url + "?token=doomed-key"):
                pass
    finally:
        srv.stop()

