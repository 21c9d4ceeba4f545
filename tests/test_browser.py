"""The demo page and browser client in real headless Chromium, against a real server on loopback.

`tests/browser/drive.mjs` (playwright-core driving Debian's /usr/bin/chromium) clicks through the page as
a person would and reports what the page shows and what the AudioWorklet player counted; the assertions
are here. Needs `apt-get install chromium` and `npm ci --prefix tests/browser`; skipped without them
only outside CI.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import websockets
from voicewire.realtime.settings import Settings

from tests.proxy import Proxy
from tests.server import API_KEY, ServerThread, free_port
from tests.wsclient import configure, recv_until, send

BROWSER_DIR = Path(__file__).parent / "browser"
DRIVER = BROWSER_DIR / "drive.mjs"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
DOCS_SCREENSHOT = Path(__file__).parent.parent / "docs" / "demo-screenshot.png"
"""Refreshed only on request (`VOICEWIRE_UPDATE_SCREENSHOT=1`): a test run leaves the checkout as it was."""

_missing = [what for what, ok in (
    (str(CHROMIUM), CHROMIUM.exists()),
    ("node", shutil.which("node") is not None),
    ("tests/browser/node_modules/playwright-core", (BROWSER_DIR / "node_modules" / "playwright-core").is_dir()),
) if not ok]
pytestmark = pytest.mark.skipif(bool(_missing) and not os.environ.get("CI"),
                                reason=f"browser tests need {', '.join(_missing)} (always run in CI)")

Record = dict[str, Any]


def drive(*args: str) -> Record:
    """Run the driver and return its report; fail with its output when it could not finish."""
    done = subprocess.run(["node", str(DRIVER), *args], capture_output=True, text=True, timeout=300,
                          cwd=BROWSER_DIR, env={**os.environ, "CHROMIUM": str(CHROMIUM)})
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"driver failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    report: Record = json.loads(lines[-1])
    assert "failure" not in report, report["failure"]
    return report


@pytest.fixture(scope="module")
def screenshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the demo's screenshot goes: docs/ when `VOICEWIRE_UPDATE_SCREENSHOT` is set, else a temp dir."""
    if os.environ.get("VOICEWIRE_UPDATE_SCREENSHOT"):
        return DOCS_SCREENSHOT
    return tmp_path_factory.mktemp("browser") / "demo-screenshot.png"


@pytest.fixture(scope="module")
def demo(server: ServerThread, screenshot: Path) -> Record:
    """One browser session: load, speak a paragraph, stop a long answer, speak again."""
    return drive("main", server.http_url, str(screenshot))


def samples_sent(rec: Record) -> int:
    """pcm16 samples the server sent for an utterance (`audio.done.total_bytes` summed by the page)."""
    return int(rec["sentBytes"]) // 2


def test_demo_page_loads_connected_without_console_errors(demo: Record, screenshot: Path) -> None:
    assert demo["errorsAfterLoad"] == []
    assert demo["consoleErrors"] == []
    assert demo["loaded"]["message"] is None
    assert demo["loaded"]["engine"] == "hibari"
    assert demo["loaded"]["connection"].startswith("connected")
    assert screenshot.stat().st_size > 10_000


def test_paragraph_plays_every_sample_the_server_sent(demo: Record) -> None:
    rec = demo["paragraph"]
    assert rec["ended"] and not rec["cancelled"]
    assert rec["serverDone"]["total_sentences"] == 3
    sent = samples_sent(rec)
    assert sent > rec["sampleRate"] * 3, "a paragraph is several seconds of audio"
    assert rec["bytesReceived"] == rec["sentBytes"]
    assert rec["receivedAtEnd"] - rec["receivedAtStart"] == sent
    assert rec["playedAtEnd"] - rec["playedAtStart"] == sent, "the worklet played every sample, no more"
    assert rec["droppedAtEnd"] == rec["droppedAtStart"]
    assert rec["samples"] == sent
    assert rec["ttfaMs"] is not None and rec["firstSoundMs"] is not None
    assert demo["stats"]["ttfa"].endswith(" ms")


def test_words_are_highlighted_in_order_when_heard(demo: Record) -> None:
    rec = demo["paragraph"]
    words, lit = rec["words"], rec["highlighted"]
    assert len(words) >= 20
    assert [h["index"] for h in lit] == list(range(len(words))), "every word, once, in order"
    assert [h["charStart"] for h in lit] == sorted(w["char_start"] for w in words)
    assert [h["word"] for h in lit] == [rec["text"][w["char_start"]:w["char_end"]] for w in words]
    rate = rec["sampleRate"]
    for h in lit:
        heard_ms = (h["played"] - rec["startIndex"]) * 1000 / rate
        assert heard_ms >= h["startMs"], f"{h['word']!r} lit before the player reached it"
    positions = [h["played"] for h in lit]
    assert positions == sorted(positions)
    assert positions[-1] - positions[0] > rate, "highlights follow playback over seconds, not event arrival"


def test_stop_silences_playback_within_one_chunk_and_the_next_utterance_plays(demo: Record) -> None:
    stopped, nxt = demo["stopped"], demo["next"]
    rate = stopped["sampleRate"]
    assert stopped["cancelled"] and not stopped["ended"]
    ack = stopped["stopAck"]
    # The worklet stops within one 100 ms chunk of where the page last saw it, and stays silent.
    assert 0 <= ack["played"] - stopped["playedAtStop"] <= rate // 10
    assert ack["buffered"] == 0 and not ack["playing"]
    assert demo["stoppedAt"] == demo["playedAfterWait"] == ack["played"]
    assert ack["played"] - stopped["startIndex"] < samples_sent(stopped) or stopped["serverDone"] is None
    assert stopped["bytesReceived"] == stopped["bytesAtStop"], "no audio of a stopped utterance after Stop"
    if stopped["serverDone"] is None:
        assert stopped["serverCancelled"]["utterance_index"] == stopped["index"]
    assert demo["statusAfterStop"] == "stopped"
    assert nxt["ended"] and not nxt["cancelled"]
    assert nxt["playedAtEnd"] - nxt["playedAtStart"] == samples_sent(nxt) > 0
    assert nxt["droppedAtEnd"] == nxt["droppedAtStart"]
    assert [h["index"] for h in nxt["highlighted"]] == list(range(len(nxt["words"])))
    assert demo["stats"]["transcript"] == nxt["text"]


UNREACHABLE = f"ws://127.0.0.1:{free_port()}/v1/audio/speech/stream"


@pytest.fixture(scope="module")
def pages(server: ServerThread, keyed_server: ServerThread) -> dict[str, Record]:
    """The page opened at each URL the tests below look at, in one browser: what it shows once it
    connected (`load`), or once Speak was pressed and it showed a message (`message`)."""
    jobs = {
        "unreachable": ["message", f"{server.http_url}/?url={UNREACHABLE}"],
        "wrong_token": ["message", f"{keyed_server.http_url}/?token=wrong-token"],
        "no_token": ["message", f"{keyed_server.http_url}/"],
        "right_token": ["load", f"{keyed_server.http_url}/?token={API_KEY}"],
    }
    reports: dict[str, Record] = drive("pages", json.dumps(jobs))
    return reports


def test_unreachable_server_shows_a_clear_message(pages: dict[str, Record]) -> None:
    shown = pages["unreachable"]
    assert shown["visible"]
    assert "not reachable" in shown["text"] and UNREACHABLE in shown["text"]
    assert shown["connection"] == "not connected"


def test_wrong_token_shows_a_clear_message(pages: dict[str, Record]) -> None:
    """The server refuses a bad key before the upgrade (HTTP 401); browsers hide the status from
    WebSocket code, so the client asks the same URL over HTTP and says what to fix."""
    shown = pages["wrong_token"]
    assert shown["visible"]
    assert shown["text"] == "The server rejected the token (HTTP 401). Check the token and try again."
    assert shown["connection"] == "not connected"


def test_missing_token_asks_for_one(pages: dict[str, Record]) -> None:
    shown = pages["no_token"]
    assert shown["text"] == "The server needs a token (HTTP 401). Add ?token=YOUR_KEY to the page URL."


def test_the_right_token_in_the_page_url_connects(pages: dict[str, Record]) -> None:
    loaded = pages["right_token"]
    assert loaded["message"] is None and loaded["connection"].startswith("connected")
    assert loaded["consoleErrors"] == []


def test_after_stop_played_shows_what_was_heard_not_the_dropped_rest(demo: Record) -> None:
    stopped = demo["stopped"]
    rate, ack = stopped["sampleRate"], stopped["stopAck"]
    heard = ack["played"] - stopped["playedAtStart"]  # the worklet's own count, from the utterance's start
    assert ack["dropped"] - stopped["droppedAtStart"] > rate // 10, "Stop dropped queued audio"
    assert demo["playedShownAfterStop"] == f"{heard / rate:.2f} s"
    assert stopped["heardSamples"] == heard == ack["at"] - stopped["startIndex"]


def test_the_page_shows_reconnecting_and_plays_on_after_its_connection_is_cut(server: ServerThread) -> None:
    """The page's WebSocket goes through a TCP proxy that cuts it mid-audio, while the text is still being
    typed (no close frame, as when a network vanishes); the client reconnects, resumes, resends the text the
    server had not applied, and the paragraph plays whole: the audio the client emitted is byte for byte
    that of an uncut run with the same seed, with the same words, and the player played every sample the
    server sent once."""
    proxy = Proxy(server.port)
    server.call(proxy.__aenter__)
    try:
        proxy.limits["down"] = 40_000  # past session.updated, inside the first sentence's audio
        report = drive("resume", f"{server.http_url}/?url={proxy.url()}&seed=7")
    finally:
        server.call(proxy.__aexit__)
    assert proxy.cut.is_set()
    assert report["reconnecting"] >= 1 and report["resumes"] == 1
    assert any(b.startswith("reconnecting") for b in report["badges"]), report["badges"]
    assert report["connection"].startswith("connected") and report["message"] is None
    rec = report["paragraph"]
    assert rec["ended"] and not rec["cancelled"] and rec["serverDone"]["total_sentences"] == 3
    assert 0 < report["typedAtCut"] < len(rec["text"]), "the cut fell while the text was being typed"
    sent = samples_sent(rec)
    assert rec["bytesReceived"] == rec["sentBytes"]
    assert rec["playedAtEnd"] - rec["playedAtStart"] == sent, "every sample played once, none skipped"
    assert report["consoleErrors"] == []

    config, audio, words = asyncio.run(uncut_run(server, rec["text"], report["config"]))
    assert report["config"] == config, "the page and the uncut run asked for the same"
    assert report["audioBytes"] == len(audio) and report["audioSha256"] == hashlib.sha256(audio).hexdigest()
    assert rec["words"] == sorted(words, key=lambda w: w["char_start"])


async def uncut_run(server: ServerThread, text: str, page_config: Record) -> tuple[Record, bytes, list[Record]]:
    """`text` spoken on a connection of its own, configured as the page was (`page_config`, the effective
    config its `session.updated` echoed): that config as echoed here, the audio, and the words."""
    asked = {k: page_config[k] for k in ("voice", "speed", "response_format", "sample_rate", "stream_audio",
                                         "split_granularity", "word_timestamps", "audio_frames", "seed")}
    async with websockets.connect(server.ws_url) as ws:
        updated = await configure(ws, **asked)
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    audio = b"".join(i for i in got.items if isinstance(i, bytes))
    return updated["config"], audio, [w for e in got.of("audio.words") for w in e["words"]]


def test_closing_the_js_client_while_it_reconnects_ends_the_session_on_the_server() -> None:
    """The JS client's socket is cut mid-audio and its first resume attempt is refused (the network is still
    down); `close()` is called meanwhile, so it falls between two attempts. The client goes on resuming only
    to deliver `session.close`: the server ends the session at once (not when its resume window of 10
    minutes passes) and keeps nothing of it; the client emits no "resumed", no error and no audio after
    `close()`, then "close" with the server's normal close."""
    srv = ServerThread(Settings(resume_window_s=600.0))
    proxy = Proxy(srv.port)
    srv.call(proxy.__aenter__)
    try:
        proxy.limits["down"] = 40_000  # past session.updated (acknowledged at once), inside the audio
        proxy.refuse_after_cut = 1
        report = drive("close-reconnecting", f"{srv.http_url}/?proxy={proxy.url()}")
        session_id = report["sessionId"]

        async def traces() -> list[str]:
            found = [f"session {s.session_id}" for s in srv.ctx.sessions if s.session_id == session_id]
            found += ["registry"] if session_id in srv.ctx.resumes else []
            found += [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith(session_id)]
            found += [f"socket from port {p}" for p in set(proxy.upstream_ports) & await srv.open_peer_ports()]
            return found

        left = srv.call(traces)
        for _ in range(300):
            if not left:
                break
            time.sleep(0.1)
            left = srv.call(traces)
        assert not left, f"left on the server after close(): {left}"
        assert proxy.cuts == 1 and proxy.refused == 1
    finally:
        srv.call(proxy.__aexit__)
        srv.stop()
    assert report["closeCalled"] and report["emitted"] == ["reconnecting 1", "reconnecting 2"], report
    assert report["audioAfterClose"] == 0
    assert report["close"]["code"] == 1000, report["close"]
    assert srv.ctx.metrics.resumes_succeeded._value.get() == 1
    assert srv.ctx.metrics.resumes_expired._value.get() == 0
    # Chromium may log the refused attempt (its own network log, which can reach the page after the report
    # is taken, in whichever words fit the moment the proxy refused it: "Error in connection establishment:
    # net::ERR_SOCKET_NOT_CONNECTED", "Error during WebSocket handshake: net::ERR_CONNECTION_RESET", ...);
    # nothing else may be logged: the client itself reports no error after close().
    refused = [e for e in report["consoleErrors"]
               if e.startswith("WebSocket connection to ") and "?session_id=" in e and " failed: " in e]
    assert len(refused) <= 1 and report["consoleErrors"] == refused, report["consoleErrors"]
