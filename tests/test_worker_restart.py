"""An engine worker process that dies is restarted; only the units it was computing fail. With several
threads in one worker process (`--engine-processes`), those are every thread's units."""

from __future__ import annotations

import asyncio
import functools
import os
import signal

import pytest
import websockets
from voicewire.adapters.workers import ProcessEngine
from voicewire.realtime.settings import Settings

from tests.faults import fault_injecting_hibari
from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send, utter

STREAM = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True}
LONG = " ".join(f"Sentence {n} of a story long enough to keep an engine worker busy for a while." for n in range(30))


async def test_killing_a_busy_worker_fails_only_its_unit_and_the_worker_comes_back() -> None:
    srv = ServerThread(Settings(engine_workers=2, engine_isolation="process"))
    try:
        engine = srv.ctx.engine
        assert isinstance(engine, ProcessEngine)
        pids_before = engine.worker_pids()
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **STREAM)
            await send(ws, {"type": "input.text", "text": LONG})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "audio.start")
            async with asyncio.timeout(60):
                while not (busy := engine.busy_worker_pids()):
                    await asyncio.sleep(0.001)
            os.kill(busy[0], signal.SIGKILL)
            got = await recv_until(ws, "session.done", got)
        errors = got.of("error")
        assert errors, "the unit on the killed worker failed"
        assert all(e["code"] == "generation_failed" and "died" in e["message"] and not e["fatal"] for e in errors)
        done = got.of("audio.done")
        assert [d["sentence_index"] for d in done] == list(range(30))
        assert sum(d["error"] for d in done) == len(errors) <= 2, "only the units on that worker failed"
        async with asyncio.timeout(120):
            while engine.stats.restarts < 1 or None in engine.worker_pids():
                await asyncio.sleep(0.05)
        assert busy[0] not in engine.worker_pids() and len(set(engine.worker_pids()) - set(pids_before)) == 1
        # The server and the replacement worker serve a new session normally.
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **STREAM)
            await send(ws, {"type": "input.text", "text": "Back to normal. Both workers answer."})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "session.done")
        assert not got.of("error") and [d["error"] for d in got.of("audio.done")] == [False, False]
    finally:
        srv.stop()


async def test_engine_processes_spread_the_workers_threads_over_fewer_children() -> None:
    """`--engine-workers 2 --engine-processes 1`, as the registry builds it: one child process computing two
    requests at once (its hibari has two threads), and two sessions speaking at the same time through it."""
    srv = ServerThread(Settings(engine_workers=2, engine_processes=1, engine_isolation="process"))
    try:
        engine = srv.ctx.engine
        assert isinstance(engine, ProcessEngine)
        assert len(engine.worker_pids()) == 1 and engine.info.max_concurrency == 2

        async def speak(text: str) -> list[bool]:
            async with websockets.connect(srv.ws_url) as ws:
                await configure(ws, **STREAM)
                got = await utter(ws, text)
            assert not got.of("error"), got.of("error")
            return [d["error"] for d in got.of("audio.done")]

        heard = await asyncio.gather(speak("One process. Two threads in it."), speak("A second voice at once."))
        assert heard == [[False, False], [False]]
        assert engine.stats.completed == 3 and engine.stats.restarts == 0
    finally:
        srv.stop()


async def test_a_worker_process_of_two_threads_that_dies_fails_both_threads_units_then_comes_back() -> None:
    build = functools.partial(fault_injecting_hibari, threads=2)
    srv = ServerThread(Settings(engine_workers=2), engine=ProcessEngine("hibari", workers=1, build=build))
    try:
        engine = srv.ctx.engine
        assert isinstance(engine, ProcessEngine) and engine.info.max_concurrency == 2
        async with websockets.connect(srv.ws_url) as a, websockets.connect(srv.ws_url) as b:
            for ws in (a, b):
                await configure(ws, **STREAM)
                await send(ws, {"type": "input.text", "text": "[hang] Held in the worker until it dies."})
                await send(ws, {"type": "input.done"})
            async with asyncio.timeout(60):
                while (s := engine.stats).started - s.completed - s.cancelled - s.failed < 2:
                    await asyncio.sleep(0.01)
            (pid,) = engine.busy_worker_pids()
            os.kill(pid, signal.SIGKILL)
            for ws in (a, b):
                got = await recv_until(ws, "session.done")
                errors = got.of("error")
                assert len(errors) == 1 and errors[0]["code"] == "generation_failed" and "died" in errors[0]["message"]
                assert [d["error"] for d in got.of("audio.done")] == [True]
        async with asyncio.timeout(120):
            while engine.stats.restarts < 1 or engine.worker_pids() == [None]:
                await asyncio.sleep(0.05)
        assert engine.worker_pids() != [pid]
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **STREAM)
            got = await utter(ws, "The replacement speaks.")
        assert not got.of("error") and [d["error"] for d in got.of("audio.done")] == [False]
    finally:
        srv.stop()


@pytest.mark.parametrize(("workers", "processes"), [(3, 2), (2, 0), (2, 3)])
def test_engine_processes_that_do_not_divide_the_workers_are_refused_before_anything_starts(
        workers: int, processes: int, capsys: pytest.CaptureFixture[str]) -> None:
    from voicewire.realtime.cli import main

    assert main(["serve", "--no-auth", "--engine-workers", str(workers), "--engine-processes", str(processes)]) == 2
    assert f"engine processes: {processes} does not divide {workers} engine workers evenly" in capsys.readouterr().err


def test_engine_processes_without_process_isolation_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from voicewire.realtime.cli import main

    assert main(["serve", "--no-auth", "--engine-isolation", "thread", "--engine-processes", "1"]) == 2
    assert "only with engine isolation 'process'" in capsys.readouterr().err
