"""Engine worker supervision against real worker processes and real signals (issue 14 #7, #15, #4).

Every test runs a real server with hibari in worker processes and kills, stops or starves those processes
with `os.kill`. Process counts come from /proc (this process's children, zombies included) and descriptor
counts from /proc/self/fd; nothing here measures time.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import websockets
from voicewire.adapters.workers import PoolHealth, ProcessEngine, WorkerStats, WorkerTimings
from voicewire.realtime.settings import Settings

from tests.faults import InjectedEngineError, fault_injecting_hibari
from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

STREAM = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True}
LONG = " ".join(f"Sentence {n} of a story long enough to keep an engine worker busy for a while." for n in range(12))
QUICK = WorkerTimings(heartbeat_s=0.2, hang_s=3.0, backoff_s=0.1, backoff_max_s=0.4, stable_s=600.0)
"""Short heartbeats and back-off so the tests move on quickly; no worker lives long enough to count as
stable, so deaths in a row add up."""


_EARLIER: set[int] = set()
"""Child processes that existed when the current test began (other suites' servers, engines, browsers)."""


@pytest.fixture(autouse=True)
def _earlier_children() -> None:
    _EARLIER.clear()
    _EARLIER.update(children())


def children() -> dict[int, str]:
    """This process's child processes started during the current test (pid -> state letter, `Z` for exited
    but not reaped), from /proc; multiprocessing's resource tracker (one for the whole run) left out."""
    me = os.getpid()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me and b"resource_tracker" not in cmdline and int(entry) not in _EARLIER:
            found[int(entry)] = state
    return found


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def until(predicate: Callable[[], bool], timeout: float = 180.0) -> None:
    """Poll `predicate` (a hang guard, not a measurement)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def health(srv: ServerThread) -> PoolHealth:
    """The pool's health, read on the server's loop."""
    engine = srv.ctx.engine
    assert isinstance(engine, ProcessEngine)

    async def read() -> PoolHealth:
        return engine.health

    return srv.call(read)


def stats(srv: ServerThread) -> WorkerStats:
    engine = srv.ctx.engine
    assert isinstance(engine, ProcessEngine)
    return engine.stats


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.json()


async def speak(srv: ServerThread, text: str) -> list[dict[str, Any]]:
    """One utterance over the WebSocket; the events it produced."""
    async with websockets.connect(srv.ws_url) as ws:
        await configure(ws, **STREAM)
        await send(ws, {"type": "input.text", "text": text})
        await send(ws, {"type": "input.done"})
        return (await recv_until(ws, "session.done")).events


def ok(events: list[dict[str, Any]]) -> bool:
    done = [e for e in events if e["type"] == "audio.done"]
    return bool(done) and not any(e["type"] == "error" for e in events) and not any(d["error"] for d in done)


async def test_a_worker_killed_again_and_again_while_it_starts_leaves_one_worker_and_no_descriptor() -> None:
    srv = ServerThread(Settings(), engine=ProcessEngine("hibari", workers=1, timings=QUICK))
    try:
        fds = open_fds()
        assert len(children()) == 1
        killed: list[int] = []
        states: list[str] = []
        for _ in range(5):
            await until(lambda: (pid := health(srv).slots[0].pid) is not None and pid not in killed)
            slot = health(srv).slots[0]
            assert slot.pid is not None
            os.kill(slot.pid, signal.SIGKILL)
            killed.append(slot.pid)
            states.append(slot.state)
        assert states[0] == "live" and "starting" in states[1:], states
        await until(lambda: health(srv).live == 1)
        procs = children()
        assert len(procs) == 1 and "Z" not in procs.values(), procs
        assert not set(killed) & set(procs), "every killed worker was reaped"
        status, body = await get_json(f"{srv.http_url}/ready")
        workers = body["engine_workers"]
        assert status == 200 and workers["live"] == 1 and workers["restarts"] == 1, body
        assert workers["slots"] == [{"state": "live", "failures": 5}], "five deaths in a row, backed off"
        async with aiohttp.ClientSession() as http, http.get(f"{srv.http_url}/metrics") as resp:
            metrics = await resp.text()
        assert 'voicewire_engine_workers{state="live"} 1.0' in metrics
        assert "voicewire_worker_restarts_total 1.0" in metrics
        assert ok(await speak(srv, "The one worker left speaks."))
        await until(lambda: open_fds() == fds)
    finally:
        srv.stop()
    assert not children(), "closing the engine reaps its workers"


async def test_a_crash_loop_ends_with_exactly_the_configured_workers_and_descriptors() -> None:
    srv = ServerThread(Settings(engine_workers=2), engine=ProcessEngine("hibari", workers=2, timings=QUICK))
    try:
        fds = open_fds()
        killed: set[int] = set()
        most_failures = 0
        for _ in range(15):  # every live worker process killed, round after round
            for pid, state in children().items():
                if state != "Z":
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            most_failures = max(most_failures, *(s.failures for s in health(srv).slots))
            await asyncio.sleep(0.3)
        assert most_failures >= 3, "deaths in a row are counted (and backed off)"
        await until(lambda: health(srv).live == 2)
        procs = children()
        assert len(procs) == 2 and "Z" not in procs.values() and not killed & set(procs), procs
        assert ok(await speak(srv, "Two workers again. Both of them answer."))
        await until(lambda: open_fds() == fds)
    finally:
        srv.stop()
    assert not children()


async def test_with_no_live_worker_units_wait_for_a_replacement_and_ready_says_503(tmp_path: Path) -> None:
    gate = tmp_path / "refuse-start"
    build = functools.partial(fault_injecting_hibari, str(gate))
    srv = ServerThread(Settings(engine_workers=2), engine=ProcessEngine("hibari", workers=2, build=build,
                                                                        timings=QUICK))
    try:
        gate.touch()  # replacements fail to start until it is gone
        for pid in children():
            os.kill(pid, signal.SIGKILL)
        await until(lambda: health(srv).live == 0)
        status, body = await get_json(f"{srv.http_url}/ready")
        assert status == 503 and body["engine_workers"]["live"] == 0, body

        async def rest() -> tuple[int, bytes]:
            async with aiohttp.ClientSession() as http, http.post(
                    f"{srv.http_url}/v1/audio/speech",
                    json={"input": "Waiting for a worker.", "voice": "alloy", "response_format": "pcm"}) as resp:
                return resp.status, await resp.read()

        requests = asyncio.gather(rest(), speak(srv, "Also waiting. Then spoken."))
        await until(lambda: health(srv).waiting >= 2 or requests.done())
        await until(lambda: min(s.failures for s in health(srv).slots) >= 2 or requests.done())
        assert not requests.done(), "nothing failed while no worker was live"
        status, body = await get_json(f"{srv.http_url}/ready")
        assert status == 503 and max(s["failures"] for s in body["engine_workers"]["slots"]) >= 2, body
        gate.unlink()
        (status, audio), events = await requests
        assert status == 200 and len(audio) > 24000
        assert ok(events)
        await until(lambda: health(srv).live == 2)
        status, body = await get_json(f"{srv.http_url}/ready")
        assert status == 200 and body["engine_workers"]["live"] == 2, body
    finally:
        srv.stop()


async def test_a_stopped_worker_is_detected_killed_and_replaced_failing_only_its_unit() -> None:
    srv = ServerThread(Settings(), engine=ProcessEngine("hibari", workers=1, timings=QUICK))
    try:
        engine = srv.ctx.engine
        assert isinstance(engine, ProcessEngine)
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **STREAM)
            await send(ws, {"type": "input.text", "text": LONG})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "audio.start")
            await until(lambda: bool(engine.busy_worker_pids()))
            stopped = engine.busy_worker_pids()[0]
            os.kill(stopped, signal.SIGSTOP)
            got = await recv_until(ws, "session.done", got)
        errors = got.of("error")
        assert len(errors) == 1 and errors[0]["code"] == "generation_failed" and not errors[0]["fatal"], errors
        assert "stopped answering" in errors[0]["message"]
        done = got.of("audio.done")
        assert [d["sentence_index"] for d in done] == list(range(12)) and sum(d["error"] for d in done) == 1
        procs = children()
        assert stopped not in procs and len(procs) == 1, procs
    finally:
        srv.stop()


async def test_a_unit_past_its_deadline_whose_work_cannot_stop_gets_its_worker_replaced() -> None:
    srv = ServerThread(Settings(unit_timeout_s=6.0),  # room for a replacement on a loaded machine
                       engine=ProcessEngine("hibari", workers=1, build=fault_injecting_hibari, timings=QUICK))
    try:
        (burning,) = children()
        events = await speak(srv, "[burn] This text keeps the phonemizer spinning.")
        errors = [e for e in events if e["type"] == "error"]
        assert [e["code"] for e in errors] == ["unit_timeout"], errors
        await until(lambda: burning not in children())  # killed and reaped: its core is free
        await until(lambda: health(srv).live == 1)
        assert len(children()) == 1
        replaced = await speak(srv, "The replacement speaks.")
        assert ok(replaced), [e for e in replaced if e["type"] in ("error", "audio.done")]
    finally:
        srv.stop()


async def test_a_typed_engine_error_in_a_worker_reaches_the_client_with_its_own_code() -> None:
    srv = ServerThread(Settings(), engine=ProcessEngine("hibari", workers=1, build=fault_injecting_hibari,
                                                        timings=QUICK))
    try:
        (pid,) = children()
        events = await speak(srv, "This one [raise-typed] fails. This one speaks.")
        errors = [e for e in events if e["type"] == "error"]
        assert [(e["code"], e["fatal"]) for e in errors] == [(InjectedEngineError.code, False)], errors
        assert "injected typed engine error" in errors[0]["message"]
        assert [d["error"] for d in events if d["type"] == "audio.done"] == [True, False]
        assert list(children()) == [pid], "an engine error is not a worker fault"
    finally:
        srv.stop()


async def test_a_cancel_the_worker_can_honour_keeps_the_worker() -> None:
    srv = ServerThread(Settings(), engine=ProcessEngine("hibari", workers=1, timings=QUICK))
    try:
        (pid,) = children()
        engine = srv.ctx.engine
        assert isinstance(engine, ProcessEngine)
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **STREAM)
            await send(ws, {"type": "input.text", "text": LONG})
            await until(lambda: bool(engine.busy_worker_pids()))
            await send(ws, {"type": "input.cancel"})
            await recv_until(ws, "audio.cancelled")
        await until(lambda: stats(srv).cancelled >= 1 and stats(srv).confirmed == stats(srv).cancelled)
        assert list(children()) == [pid] and stats(srv).restarts == 0
        assert ok(await speak(srv, "Still the same worker."))
    finally:
        srv.stop()



async def test_health_reads_on_every_loop_turn_survive_workers_dying_and_being_reaped(tmp_path: Path) -> None:
    """`/ready` and every metrics scrape read the pool's health, at any moment of the event loop, including
    the turn between a dead worker's process object being closed and its slot letting go of it. A reader
    that runs on every turn of the server's loop while workers die, fail to start and are reaped never
    sees an error."""
    gate = tmp_path / "refuse-start"
    build = functools.partial(fault_injecting_hibari, str(gate))
    srv = ServerThread(Settings(engine_workers=2), engine=ProcessEngine("hibari", workers=2, build=build,
                                                                        timings=QUICK))
    engine = srv.ctx.engine
    assert isinstance(engine, ProcessEngine)
    errors: list[BaseException] = []
    reads = 0
    running = True

    def read_every_turn() -> None:
        nonlocal reads
        try:
            engine.health  # noqa: B018 (the read is the test)
            reads += 1
        except Exception as exc:  # recorded, asserted below
            errors.append(exc)
        if running:
            srv.loop.call_soon(read_every_turn)

    srv.loop.call_soon_threadsafe(read_every_turn)
    try:
        gate.touch()
        for pid in children():
            os.kill(pid, signal.SIGKILL)
        await until(lambda: min(s.failures for s in health(srv).slots) >= 3)
        gate.unlink()
        await until(lambda: health(srv).live == 2)
    finally:
        running = False
        gate.unlink(missing_ok=True)
        srv.stop()
    assert reads > 100 and errors == [], errors[:3]
