"""Three real voicewire servers behind Debian's HAProxy on loopback, running `deploy/haproxy.cfg` itself (its
addresses set through the environment variables it reads): sessions and requests spread over the servers;
SIGTERM drains one without losing an utterance while new sessions go to the others; a voice uploaded
through the balancer is known to every server at once; a killed server's clients see their connection end
at once and new sessions go to the others; a client whose own connection is cut resumes its session on the
server that holds it (HAProxy routes on the session id).

Each server is `python -m voicewire.realtime` as a user runs it (API key file, shared voices directory,
`--trust-forwarded-for`), on hibari with one worker; texts are short, so the run stays modest on two cores.
Needs Debian's haproxy (`apt-get install haproxy`; `.ci/run` installs it): skipped without it outside CI.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import soundfile as sf
import websockets
from voicewire_client import AudioData, AudioDone, ErrorEvent, Session, SessionDone
from voicewire_client import connect as client_connect
from websockets.asyncio.client import ClientConnection

from tests.proxy import Proxy
from tests.rest_audio import tone
from tests.server import Loopback, free_ports
from tests.wsclient import Received, configure, recv_until, send

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "deploy" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
KEY = "vw-balancer-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ("voicewire-0", "voicewire-1", "voicewire-2")
SERVED_BY = "X-Voicewire-Server"
SESSION = {"split_granularity": "sentence", "response_format": "pcm"}

pytestmark = pytest.mark.skipif(HAPROXY is None and not os.environ.get("CI"),
                                reason="the balancer tests need Debian's haproxy (apt-get install haproxy; "
                                "always run in CI)")


@dataclass
class Backend(Loopback):
    """One voicewire server process; `start` runs it again after it stopped (same port, same log)."""

    name: str
    port: int
    log: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "voicewire.realtime", "--port", str(self.port), *self.args],
                stdout=out, stderr=subprocess.STDOUT)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready_status(self) -> int:
        return httpx.get(f"{self.http_url}/ready", timeout=5).status_code

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(30)


class Cluster(Loopback):
    """Three servers sharing a voices directory and a key file, and HAProxy in front of them; each server runs
    the engine `engine_args` describe (default hibari, one worker), all started at once."""

    def __init__(self, root: Path, engine_args: Sequence[str] = ("--engine-workers", "1")) -> None:
        assert HAPROXY is not None, "haproxy is not installed (apt-get install haproxy)"
        self.root = root
        self.voices = root / "voices"
        keys = root / "keys"
        keys.write_text(f"# the balancer test's key\n{KEY}\n")
        args = [*engine_args, "--voices-dir", str(self.voices), "--api-keys-file", str(keys),
                "--trust-forwarded-for"]
        *ports, self.port, self.stats_port = free_ports(len(NAMES) + 2)
        self.backends = {name: Backend(name, port, root / f"{name}.log", [*args, "--server-id", name])
                         for name, port in zip(NAMES, ports, strict=True)}
        env = {**os.environ, "VOICEWIRE_BALANCER_BIND": f"127.0.0.1:{self.port}",
               "VOICEWIRE_STATS_BIND": f"127.0.0.1:{self.stats_port}"}
        for index, backend in enumerate(self.backends.values()):
            env[f"VOICEWIRE_SERVER_{index}"] = f"127.0.0.1:{backend.port}"
        for backend in self.backends.values():
            backend.start()
        with (root / "haproxy.log").open("ab") as out:
            self.haproxy = subprocess.Popen([HAPROXY, "-f", str(CONFIG), "-db"], env=env, stdout=out,
                                            stderr=subprocess.STDOUT)

    def states(self) -> dict[str, str]:
        """Each server's state as HAProxy sees it (`UP`, `DOWN`, `DOWN 1/2`, ...)."""
        return {name: row["status"] for name, row in self.stats().items()}

    def stats(self) -> dict[str, dict[str, str]]:
        """Each server's row of HAProxy's statistics (CSV columns by name: `status`, `check_status`, ...)."""
        csv = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        lines = csv.splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
        return {row["svname"]: row for row in rows if row["pxname"] == "voicewire" and row["svname"] in NAMES}

    def explain(self) -> str:
        """Why a server is not UP, for a failure message: HAProxy's view of its last check, the server's own
        answer to `/ready`, and its log's last lines."""
        lines: list[str] = []
        seen: dict[str, dict[str, str]] = {}
        try:
            seen = self.stats()
        except (httpx.HTTPError, OSError) as e:
            lines.append(f"HAProxy's statistics: {e!r}")
        for name, backend in self.backends.items():
            row = seen.get(name, {})
            try:
                answer = httpx.get(f"{backend.http_url}/ready", timeout=10)
                ready = f"{answer.status_code} {answer.text[:300]}"
            except (httpx.HTTPError, OSError) as e:
                ready = repr(e)
            tail = backend.log.read_text(errors="replace").splitlines()[-8:] if backend.log.exists() else []
            lines += [f"{name}: {row.get('status')} (last check {row.get('check_status')} "
                      f"{row.get('check_code')} in {row.get('check_duration')} ms, {row.get('last_chk')!r}); "
                      f"/ready now: {ready}", *[f"    {line}" for line in tail]]
        return "\n".join(lines)

    async def all_up(self, timeout: float = 120.0) -> None:
        """Start any server that is not running, then wait (at most `timeout` s) until HAProxy routes to all
        three, each UP after a health check of its own."""
        assert self.haproxy.poll() is None, "haproxy exited; see haproxy.log"
        for backend in self.backends.values():
            if not backend.running:
                backend.start()

        def up() -> bool:
            dead = [backend.log.name for backend in self.backends.values() if not backend.running]
            assert not dead, f"a server exited while starting; see {', '.join(dead)} in {self.root}\n{self.explain()}"
            # UP after a check that passed: before its first check HAProxy shows a server UP (check status
            # INI), so a cluster read that early would look ready while its servers are still starting.
            rows = self.stats().values()
            return len(rows) == len(NAMES) and all(
                row["status"] == "UP" and row["check_status"].lstrip("* ") == "L7OK" for row in rows)

        await until(up, "every server UP in HAProxy", timeout, self.explain)

    def stop(self) -> None:
        self.haproxy.terminate()
        self.haproxy.wait(30)
        for backend in self.backends.values():
            backend.stop()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 120.0,
                explain: Callable[[], str] | None = None) -> None:
    """Wait (at most `timeout` s) until `predicate()` holds, an HTTP or socket error counting as not yet;
    on timeout an AssertionError names `what`, with `explain()`'s account when given."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    if predicate():
                        return
                except (httpx.HTTPError, OSError):
                    pass
                await asyncio.sleep(0.1)
    except TimeoutError:
        detail = "" if explain is None else f"\n{explain()}"
        raise AssertionError(f"timed out waiting for {what}{detail}") from None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = Cluster(tmp_path_factory.mktemp("balancer"))
    try:
        yield running
    finally:
        running.stop()


@asynccontextmanager
async def session(cluster: Cluster) -> AsyncIterator[tuple[ClientConnection, str]]:
    """A configured WebSocket session through the balancer, and the name of the server it reached."""
    async with websockets.connect(cluster.ws_url, additional_headers=AUTH) as ws:
        assert ws.response is not None
        await configure(ws, **SESSION)
        yield ws, ws.response.headers[SERVED_BY]


@dataclass
class Spoken:
    """One utterance as its client saw it."""

    server: str
    got: Received = field(default_factory=Received)

    @property
    def sentences(self) -> list[str]:
        return [str(e["sentence_text"]) for e in self.got.of("audio.start")]

    @property
    def finished(self) -> bool:
        """Its `session.done`, every unit paired, audio in every unit, no error."""
        done = self.got.of("session.done")
        units = len(self.got.of("audio.start"))
        return (len(done) == 1 and done[0]["total_sentences"] == units == len(self.got.of("audio.done"))
                and not self.got.of("error") and all(e["total_bytes"] > 0 for e in self.got.of("audio.done")))


async def speak(ws: ClientConnection, server: str, text: str) -> Spoken:
    await send(ws, {"type": "input.text", "text": text})
    await send(ws, {"type": "input.done"})
    spoken = Spoken(server)
    await recv_until(ws, "session.done", spoken.got)
    return spoken


async def closed_code(ws: ClientConnection, timeout: float = 60.0) -> int | None:
    """Read until the connection ends; the close code the server sent (None: no close frame)."""
    with pytest.raises(websockets.ConnectionClosed) as closed:
        async with asyncio.timeout(timeout):
            while True:
                await ws.recv()
    return None if closed.value.rcvd is None else closed.value.rcvd.code


async def new_sessions(cluster: Cluster, count: int) -> list[Spoken]:
    """`count` sessions opened together through the balancer, each speaking one short utterance."""
    async def one(index: int) -> Spoken:
        async with session(cluster) as (ws, server):
            return await speak(ws, server, f"New session {index} speaks.")
    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def speech_requests(cluster: Cluster, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=cluster.http_url, headers=AUTH, timeout=60) as client:
        return list(await asyncio.gather(*(
            client.post("/v1/audio/speech", json={"model": "tts-1", "input": f"Request {i}.", "voice": "alloy",
                                                  "response_format": "pcm"})
            for i in range(count))))


@asynccontextmanager
async def one_session_per_server(cluster: Cluster) -> AsyncIterator[dict[str, ClientConnection]]:
    """Sessions through the balancer, held open until every server has one; the first of each, by server."""
    async with AsyncExitStack() as stack:
        held: dict[str, ClientConnection] = {}
        for _ in range(3 * len(NAMES)):
            ws, server = await stack.enter_async_context(session(cluster))
            held.setdefault(server, ws)
            if len(held) == len(NAMES):
                break
        assert sorted(held) == list(NAMES), "the balancer never reached some server"
        yield held


async def test_sessions_and_speech_requests_spread_over_the_servers(cluster: Cluster) -> None:
    await cluster.all_up()
    spoken = await new_sessions(cluster, 6)
    assert all(s.finished for s in spoken), [s.got.types() for s in spoken]
    assert set(Counter(s.server for s in spoken)) == set(NAMES)

    responses = await speech_requests(cluster, 6)
    assert [r.status_code for r in responses] == [200] * 6
    assert all(len(r.content) > 0 and len(r.content) % 2 == 0 for r in responses)
    assert {r.headers[SERVED_BY] for r in responses} == set(NAMES)


def wav_sample(seconds: float = 1.5, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, tone(seconds, rate), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


async def voice_refusal(ws: ClientConnection, voice: str) -> str:
    """Ask this session for `voice`; the message of the (non-fatal) error this engine answers with."""
    await send(ws, {"type": "session.config", **SESSION, "voice": voice})
    got = await recv_until(ws, "error")
    error = got.of("error")[-1]
    assert error["fatal"] is False and error["param"] == "voice", error
    return str(error["message"])


async def test_a_voice_uploaded_through_the_balancer_is_known_to_every_server_at_once(cluster: Cluster) -> None:
    await cluster.all_up()
    async with one_session_per_server(cluster) as held:
        # Sessions opened before the upload: each server finds the voice at its next lookup.
        async with httpx.AsyncClient(base_url=cluster.http_url, headers=AUTH, timeout=60) as client:
            uploaded = await client.post("/v1/audio/voices", files={"audio_sample": ("s.wav", wav_sample())},
                                         data={"name": "everywhere", "consent": "consent-on-file-7"})
            assert uploaded.status_code == 200, uploaded.text
            for server, ws in held.items():
                # The embedded engine cannot clone: every server resolves the name as an uploaded voice
                # (not an unknown one) and says that is why it cannot use it.
                message = await voice_refusal(ws, "everywhere")
                assert "'everywhere' is an uploaded voice" in message, (server, message)
            for backend in cluster.backends.values():
                listing = (await client.get(f"{backend.http_url}/v1/audio/voices")).json()
                assert [v["name"] for v in listing["uploaded_voices"]] == ["everywhere"], backend.name

            deleted = await client.delete("/v1/audio/voices/everywhere")
            assert deleted.status_code == 200, deleted.text
            for server, ws in held.items():
                message = await voice_refusal(ws, "everywhere")
                assert "unknown voice 'everywhere'" in message, (server, message)
    assert sorted(p.name for p in cluster.voices.iterdir()) == []


@dataclass
class Heard:
    """What the Python client yielded of one utterance."""

    audio: bytes = b""
    units: list[AudioDone] = field(default_factory=list)
    done: SessionDone | None = None
    errors: list[ErrorEvent] = field(default_factory=list)


async def hear(session: Session, first_audio: asyncio.Event) -> Heard:
    heard = Heard()
    async for event in session:
        if isinstance(event, AudioData):
            heard.audio += event.data
            first_audio.set()
        elif isinstance(event, AudioDone):
            heard.units.append(event)
        elif isinstance(event, ErrorEvent):
            heard.errors.append(event)
        elif isinstance(event, SessionDone):
            heard.done = event
            break
    return heard


async def test_a_cut_client_connection_resumes_on_the_server_that_holds_the_session(cluster: Cluster) -> None:
    await cluster.all_up()
    async with Proxy(cluster.port) as proxy, AsyncExitStack() as stack:
        # The real Python client (it resumes by itself) through a TCP proxy that can cut its connection, in
        # front of the balancer.
        client = await stack.enter_async_context(client_connect(proxy.url(), token=KEY))
        home = (await client.configure(**SESSION)).session_id.split(".")[0]
        assert home in NAMES
        # Make its server the busiest, so that without routing on the session id the resume would go to
        # another server (least connections) and be refused there.
        others: dict[str, list[ClientConnection]] = {name: [] for name in NAMES}
        while len(others[home]) < 2:
            ws, server = await stack.enter_async_context(session(cluster))
            others[server].append(ws)
        for name, held in others.items():
            for ws in held if name != home else []:
                await ws.close()

        await client.send_text("One line here. Another line there. A last line ends it.")
        await client.done()
        first_audio = asyncio.Event()
        listening = asyncio.create_task(hear(client, first_audio))
        await first_audio.wait()
        proxy.abort()  # the client's connection dies mid-reply, no close frame; the server keeps the session
        got = await asyncio.wait_for(listening, 120)
    # A resume that reached another server would be refused (resume_unknown) and end the iteration.
    assert proxy.cut.is_set() and client.reconnects == 1 and not got.errors, got.errors
    assert got.done is not None and got.done.total_sentences == len(got.units) == 3
    assert len(got.audio) == sum(u.total_bytes for u in got.units) > 0, "every byte once, none twice"


async def test_sigterm_drains_a_server_new_sessions_go_elsewhere_and_no_utterance_is_lost(
        cluster: Cluster) -> None:
    await cluster.all_up()
    lines = ["The first line is short.", "The second line is too.", "And a third one ends it."]
    async with one_session_per_server(cluster) as held:
        target = cluster.backends["voicewire-1"]
        draining = held["voicewire-1"]
        others = {name: ws for name, ws in held.items() if name != "voicewire-1"}
        before = [await speak(ws, name, f"Client {name} says hello. It is short.") for name, ws in held.items()]

        # The target's client is mid-reply, as an LLM streams it: one sentence spoken, the next arriving.
        await send(draining, {"type": "input.text", "text": lines[0] + " The second li"})
        open_reply = Spoken("voicewire-1")
        await recv_until(draining, "audio.start", open_reply.got)
        assert target.proc is not None
        target.proc.send_signal(signal.SIGTERM)
        assert target.ready_status() == 503

        # New sessions and requests at once (before HAProxy's next check: the server's 503 is retried on
        # another), and again once HAProxy has taken the server out.
        during = await new_sessions(cluster, 3)
        requests = await speech_requests(cluster, 2)
        await until(lambda: cluster.states()["voicewire-1"].startswith("DOWN"), "HAProxy to take voicewire-1 out")
        during += await new_sessions(cluster, 3)
        requests += await speech_requests(cluster, 2)
        assert target.running, "the server stays up while its session has an utterance open"
        elsewhere = [await speak(ws, name, f"Client {name} goes on.") for name, ws in others.items()]

        # The open reply is finished where it started, then the session is closed (1001).
        await send(draining, {"type": "input.text", "text": "ne is too. " + lines[2]})
        await send(draining, {"type": "input.done"})
        await recv_until(draining, "session.done", open_reply.got)
        assert await closed_code(draining) == 1001
    assert target.proc.wait(30) == 0

    # The client opens a new session for its next reply: it lands on another server.
    async with session(cluster) as (ws, server):
        after = await speak(ws, server, "The reply after the drain.")

    assert all(s.finished for s in [*before, *during, *elsewhere, open_reply, after])
    assert open_reply.sentences == lines, "the utterance open at SIGTERM was finished whole, on the same server"
    assert "voicewire-1" not in {s.server for s in [*during, after]}
    assert [r.status_code for r in requests] == [200] * 4
    assert "voicewire-1" not in {r.headers[SERVED_BY] for r in requests}


async def test_a_killed_servers_clients_see_the_connection_end_and_new_sessions_go_to_the_others(
        cluster: Cluster) -> None:
    await cluster.all_up()
    async with one_session_per_server(cluster) as held, AsyncExitStack() as stack:
        target = cluster.backends["voicewire-2"]
        victim = held["voicewire-2"]
        # And the Python client (it resumes by itself) on the same server.
        client = None
        for _ in range(3 * len(NAMES)):
            opened = await stack.enter_async_context(client_connect(cluster.ws_url, token=KEY))
            if (await opened.configure(**SESSION)).session_id.startswith("voicewire-2."):
                client = opened
                break
        assert client is not None, "no Python client session reached voicewire-2"
        await send(victim, {"type": "input.text", "text": "One line here. Another line there. A last line."})
        await send(victim, {"type": "input.done"})
        await client.send_text(" ".join(f"Line number {n} is long enough to be still speaking." for n in range(8)))
        await client.done()
        first_audio = asyncio.Event()
        listening = asyncio.create_task(hear(client, first_audio))
        cut = await recv_until(victim, "audio.start")
        await first_audio.wait()
        assert target.proc is not None
        target.proc.kill()
        # No hang: the balancer ends the client's connection as soon as the server's is gone (long before
        # any timeout). A dead server sends no close frame, so the client sees 1006 and opens a new session.
        assert await closed_code(victim, timeout=30) is None
        assert cut.of("audio.start") and not cut.of("error")
        # The Python client tries to resume; the balancer sends the resume to a live server, which has no
        # such session: the client yields that refusal and its session ends (no hang, no retry loop).
        heard = await asyncio.wait_for(listening, 30)
        assert [e.code for e in heard.errors] == ["resume_unknown"] and heard.done is None, heard.errors
        assert client.closed and client.reconnects == 0

        # Sessions on the other servers go on; new ones go to them, at once and after HAProxy noticed.
        survivors = [await speak(ws, name, f"Client {name} is fine.")
                     for name, ws in held.items() if name != "voicewire-2"]
        at_once = await new_sessions(cluster, 3)
        await until(lambda: cluster.states()["voicewire-2"].startswith("DOWN"), "HAProxy to take voicewire-2 out")
        later = await new_sessions(cluster, 3)
        requests = await speech_requests(cluster, 2)
        # A resume of a session of the dead server reaches a live one, which knows no such session.
        url = f"{cluster.ws_url}?session_id=voicewire-2.sess_000000"
        async with websockets.connect(url, additional_headers=AUTH) as resuming:
            await send(resuming, {"type": "session.resume", "session_id": "voicewire-2.sess_000000",
                                  "token": "vwr_x", "seq": 0})
            refused = (await recv_until(resuming, "error")).of("error")
            assert resuming.response is not None and resuming.response.headers[SERVED_BY] != "voicewire-2"
        assert refused[0]["code"] == "resume_unknown", refused
    assert all(s.finished for s in [*survivors, *at_once, *later])
    assert "voicewire-2" not in {s.server for s in [*at_once, *later]} | {r.headers[SERVED_BY] for r in requests}
    assert [r.status_code for r in requests] == [200, 200]
