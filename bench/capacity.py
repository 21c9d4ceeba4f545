"""Realtime capacity: the most concurrent sessions that never run dry, against the engine's own ceiling.

The server runs as its own process (`python -m voicewire.realtime --engine-workers W`, uvloop); the
clients run here, one asyncio task per session over the real `websockets` library. Each session speaks
reply after reply like a voice agent: the reply's text (2-3 random sentences) is sent as ~4-character
deltas at an LLM's pace (15 tokens/s by default) in `sentence` mode with streamed `pcm`, then
`input.done`; the next reply starts once the previous one has finished playing (plus `--gap`).

Playback model, per reply: playback starts at the reply's first audio byte and plays in real time; a
binary frame that arrives after everything before it would have finished playing is an *underrun*, and
playback pauses until it arrives (the pause is that session's *stall time*). TTFA is from sending the
delta that completes the first unit (the server's own segmenter, run here on the same deltas, says which)
to the first audio byte.

The search doubles N from `--start` until a trial has an underrun, then bisects. Before each trial, with
the server idle, an in-process `HibariEngine(workers=W)` runs flat out on the same sentences for
`--ceiling-s`: its aggregate real-time factor (audio seconds per wall second) is the ceiling, the number
of real-time streams the engine alone sustains on this machine right then (the median over the trials is
reported; a shared machine's spare CPU drifts, so each trial also shows its own). Server CPU per thread
(event loop vs the rest), its run-queue wait (time its threads were runnable but had no core) and the
client's own loop lag are reported, so a failed trial can be blamed on the right party.

Rounds (`--rounds`, default 3): the search (or `--sessions N,...`, or `--fractions F,...`: N = each fraction
of the engine-only ceiling measured once before round 1, to test a target such as 0.80 of it directly) is
round 1; each later round runs one trial at every N that round 1 ran. An N counts as passed only with zero
underruns in every round, as every smaller N tried had; the report gives underruns per round and the other
figures as median [min-max] over rounds, under a line naming the date, the machine and the commit.
`--budget-s` starts no trial past that many seconds (a device call's deadline); an N that missed a round
does not count as passed.

Run from the repository root: `python -m bench.capacity` (see `--help`; docs/benchmarks.md has results).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import websockets
from voicewire.adapters.hibari import HibariEngine
from voicewire.protocol.engine import SynthesisRequest
from websockets.asyncio.client import ClientConnection

from bench.workload import (
    SENTENCES,
    Provenance,
    ServerProcess,
    children,
    dump_json,
    first_unit,
    held_every_round,
    percentile,
    schedstat,
    spread,
    spreads,
    table,
    tokens,
    utterance,
)

BYTES_PER_SECOND = 24000 * 2
"""pcm s16le mono at the engine's native 24 kHz (the bench asks for no resampling)."""

Compression = Literal["deflate", "none"]


@dataclass
class Reply:
    """One utterance as a client heard it."""

    ttfa_s: float
    audio_s: float
    stall_s: float
    units: int
    underrun_units: list[int]
    """For each underrun, the index in the reply of the unit whose audio came late (0 = the first)."""
    margins: list[tuple[int, float]]
    """For each unit after the first: (its index, seconds of audio still to play when its first frame
    arrived; negative = it came late)."""
    plays_from: float
    plays_until: float
    """Monotonic times the reply's playback starts and ends (stalls included)."""


@dataclass
class Trial:
    sessions: int
    round: int = 0
    replies: list[Reply] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    server_loop_cpu: float = 0.0
    server_other_cpu: float = 0.0
    server_runq_wait: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    """Server CPU (cores) over the steady window by component (`CapacityServer.components`)."""
    client_cpu: float = 0.0
    client_lag_max_ms: float = 0.0
    window: tuple[float, float] = (0.0, 0.0)
    """Steady state: every session has started and replies still start (monotonic seconds)."""
    ceiling: dict[str, float] = field(default_factory=dict)
    """The engine-only run just before this trial."""

    @property
    def streams_playing(self) -> float:
        """Mean number of replies playing at once during the steady window (real-time streams served)."""
        lo, hi = self.window
        if hi <= lo:
            return 0.0
        overlap = sum(max(0.0, min(hi, r.plays_until) - max(lo, r.plays_from)) for r in self.replies)
        return overlap / (hi - lo)

    @property
    def cpu_per_stream_ms(self) -> float:
        """Server CPU milliseconds (all threads) per second of audio played, over the steady window."""
        playing = self.streams_playing
        return (self.server_loop_cpu + self.server_other_cpu) / playing * 1000.0 if playing else float("nan")

    @property
    def underruns(self) -> int:
        return sum(len(r.underrun_units) for r in self.replies)

    def component_ms(self) -> dict[str, float]:
        """Each server component's CPU milliseconds per second of audio played, over the steady window."""
        playing = self.streams_playing
        return {name: cores / playing * 1000.0 if playing else float("nan")
                for name, cores in self.components.items()}

    def margins(self) -> str:
        """p1 / p5 / p50 margin (ms of audio left when a unit's first frame arrived) for the second unit of
        a reply and for later ones."""
        second = [m * 1000.0 for r in self.replies for u, m in r.margins if u == 1]
        later = [m * 1000.0 for r in self.replies for u, m in r.margins if u > 1]
        return "  ".join(f"{name} {percentile(v, 1):.0f}/{percentile(v, 5):.0f}/{percentile(v, 50):.0f}"
                         for name, v in (("#1", second), ("#2+", later)) if v)

    def underruns_by_unit(self) -> str:
        """Underruns counted by the index in its reply of the unit that came late: "#1:5,#2:1"."""
        counts: dict[int, int] = {}
        for reply in self.replies:
            for unit in reply.underrun_units:
                counts[unit] = counts.get(unit, 0) + 1
        return ",".join(f"#{unit}:{count}" for unit, count in sorted(counts.items()))

    @property
    def passed(self) -> bool:
        return not self.errors and self.underruns == 0 and bool(self.replies)

    def summary(self) -> dict[str, float | int | bool]:
        ttfa = [r.ttfa_s * 1000.0 for r in self.replies]
        audio = sum(r.audio_s for r in self.replies)
        return {
            "sessions": self.sessions, "round": self.round, "passed": self.passed, "replies": len(self.replies),
            "units": sum(r.units for r in self.replies), "underruns": self.underruns,
            "stall_total_s": sum(r.stall_s for r in self.replies),
            "stall_max_s": max((r.stall_s for r in self.replies), default=0.0), "errors": len(self.errors),
            "ttfa_p50_ms": percentile(ttfa, 50), "ttfa_p95_ms": percentile(ttfa, 95),
            "ttfa_max_ms": max(ttfa, default=float("nan")),
            "audio_s": audio, "streams_playing": self.streams_playing,
            "ceiling_rtf": self.ceiling.get("aggregate_rtf", float("nan")),
            "server_cpu_ms_per_audio_s": self.cpu_per_stream_ms,
            "engine_cpu_ms_per_audio_s": self.ceiling.get("cpu_ms_per_audio_s", float("nan")),
            "ceiling_runq_wait": self.ceiling.get("runq_wait", float("nan")),
            "server_loop_cpu": self.server_loop_cpu, "server_other_cpu": self.server_other_cpu,
            "server_runq_wait": self.server_runq_wait,
            "client_cpu": self.client_cpu, "client_lag_max_ms": self.client_lag_max_ms,
            **{f"cpu_ms_per_audio_s.{name}": ms for name, ms in self.component_ms().items()},
        }


# -- ceiling ----------------------------------------------------------------------------------------------


class Ceiling:
    """A started `HibariEngine(workers)` in this process, idle except while `measure` keeps it saturated."""

    def __init__(self, workers: int, seed: int, cpus: set[int] | None = None,
                 client_cpus: set[int] | None = None) -> None:
        self.engine = HibariEngine(workers=workers)
        self.workers = workers
        self.rng = random.Random(seed)
        self.requests = 0
        self.cpus = cpus
        self.client_cpus = client_cpus
        """With `cpus`, the engine-only run is pinned to the server's cores (every thread of this process
        while it runs) and this process goes back to `client_cpus` (or all cores) afterwards."""

    async def measure(self, seconds: float) -> dict[str, float]:
        """Aggregate real-time factor (audio seconds per wall second) over `seconds` of back-to-back requests,
        with this process's CPU and run-queue wait (cores) meanwhile."""
        engine = self.engine
        audio_samples = 0
        deadline = time.monotonic() + seconds

        async def feeder() -> None:
            nonlocal audio_samples
            while time.monotonic() < deadline:
                self.requests += 1
                request = SynthesisRequest(request_id=f"ceiling-{self.requests}",
                                           text=self.rng.choice(SENTENCES), voice=engine.info.voices[0])
                async for piece in engine.synthesize(request):
                    audio_samples += len(piece.samples)

        if self.cpus:
            pin_threads(self.cpus)
        started = time.monotonic()
        before = schedstat(os.getpid())
        try:
            # two feeders per worker, so a worker never waits for the event loop to hand it the next job
            await asyncio.gather(*(feeder() for _ in range(2 * self.workers)))
        finally:
            wall = time.monotonic() - started
            after = schedstat(os.getpid())
            if self.cpus:
                pin_threads(self.client_cpus or set(range(os.cpu_count() or 1)))
        return {"aggregate_rtf": audio_samples / engine.info.sample_rate / wall, "seconds": wall,
                "cpu": (after[0] + after[1] - before[0] - before[1]) / wall,
                "cpu_ms_per_audio_s": (after[0] + after[1] - before[0] - before[1]) * 1000.0
                / (audio_samples / engine.info.sample_rate),
                "runq_wait": (after[2] - before[2]) / wall}


def pin_threads(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit the caller's mask)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def parse_cpus(text: str) -> set[int]:
    """"0,1" or "0-3" or "0-1,4" -> the set of core numbers."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


# -- one session ------------------------------------------------------------------------------------------


class Session:
    def __init__(self, ws: ClientConnection, rng: random.Random, args: argparse.Namespace, trial: Trial) -> None:
        self.ws = ws
        self.rng = rng
        self.args = args
        self.trial = trial

    async def run(self, start_at: float, stop_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < stop_at:
            text = utterance(self.rng, self.rng.randint(2, 3))
            reply = await self.reply(text)
            if reply is None:
                return
            self.trial.replies.append(reply)
            await asyncio.sleep(max(0.0, reply.plays_until - time.monotonic()) + self.rng.uniform(0, 2 * self.args.gap))

    async def reply(self, text: str) -> Reply | None:
        deltas = tokens(text)
        found = first_unit(deltas, "sentence")
        commit_index = found[0] if found is not None else len(deltas)
        committed_at: list[float] = []

        async def send_text() -> None:
            began = time.monotonic()
            for index, delta in enumerate(deltas):
                await asyncio.sleep(max(0.0, began + index / self.args.tokens_per_s - time.monotonic()))
                if index == commit_index:
                    committed_at.append(time.monotonic())
                await self.ws.send(json.dumps({"type": "input.text", "text": delta}))
            await asyncio.sleep(max(0.0, began + len(deltas) / self.args.tokens_per_s - time.monotonic()))
            if commit_index == len(deltas):
                committed_at.append(time.monotonic())
            await self.ws.send(json.dumps({"type": "input.done"}))

        sender = asyncio.create_task(send_text())
        frames: list[tuple[float, int, int]] = []
        units = 0
        started = -1
        try:
            while True:
                frame = await self.ws.recv()
                if isinstance(frame, bytes):
                    frames.append((time.monotonic(), len(frame), started))
                    continue
                event = json.loads(frame)
                kind = event["type"]
                if kind == "audio.start":
                    started += 1
                elif kind == "audio.done":
                    units += 1
                elif kind == "session.done":
                    break
                elif kind == "error":
                    self.trial.errors.append(f"{event.get('code')}: {event.get('message')}")
        except websockets.ConnectionClosed as exc:
            self.trial.errors.append(f"connection closed: {exc}")
            sender.cancel()
            return None
        await sender
        if not frames:
            self.trial.errors.append("reply without audio")
            return None
        late, margins, stall, plays_until = _playback(frames)
        ttfa = frames[0][0] - committed_at[0]
        audio_s = sum(n for _, n, _ in frames) / BYTES_PER_SECOND
        return Reply(ttfa, audio_s, stall, units, late, margins, frames[0][0], plays_until)


def _playback(frames: list[tuple[float, int, int]]) -> tuple[list[int], list[tuple[int, float]], float, float]:
    """Real-time playback from the first frame: (the unit of each underrun, each later unit's margin,
    stall seconds, when playback ends)."""
    late: list[int] = []
    margins: list[tuple[int, float]] = []
    stall = 0.0
    plays_until = frames[0][0]
    previous = frames[0][2]
    for index, (arrived, size, unit) in enumerate(frames):
        if unit != previous:
            margins.append((unit, plays_until - arrived))
            previous = unit
        if index and arrived > plays_until:
            late.append(unit)
            stall += arrived - plays_until
        plays_until = max(plays_until, arrived) + size / BYTES_PER_SECOND
    return late, margins, stall, plays_until


# -- trials -----------------------------------------------------------------------------------------------


class CapacityServer(ServerProcess):
    """The server under test, with the CPU accounting the capacity figures need."""

    def __init__(self, workers: int, isolation: str, cpus: set[int] | None = None,
                 processes: int | None = None) -> None:
        extra = ["--engine-workers", str(workers), "--engine-isolation", isolation]
        if processes is not None:
            extra += ["--engine-processes", str(processes)]
        super().__init__("hibari", extra=extra, cpus=cpus)

    def cpu_seconds(self) -> tuple[float, float, float]:
        """(event-loop thread CPU, CPU of all other threads and of the engine's child processes, run-queue
        wait of all of them) seconds so far; the wait is time a runnable thread spent waiting for a core
        (the machine was oversubscribed)."""
        loop, other, wait = schedstat(self.proc.pid)
        for child in children(self.proc.pid):
            with contextlib.suppress(OSError):
                main, rest, child_wait = schedstat(child)
                other += main + rest
                wait += child_wait
        return loop, other, wait

    def components(self) -> dict[str, float]:
        """CPU seconds so far by component (threads are told apart by kernel thread names, see
        `THREAD_COMPONENTS`): the server's event loop (sessions, rendering, encoding, JSON, socket writes),
        its other threads (the worker pipes' reader threads: receiving and decoding pieces), the engine
        processes' event loops (dispatch, sending pieces to the pipe), their engine threads (the model and
        its DSP) and their other threads."""
        totals = dict.fromkeys(COMPONENTS, 0.0)
        for tid, _name, cpu in threads(self.proc.pid):
            totals["loop" if tid == self.proc.pid else "server threads"] += cpu
        for child in children(self.proc.pid):
            for tid, name, cpu in threads(child):
                if tid == child:
                    totals["worker loops"] += cpu
                elif name.startswith(ENGINE_THREADS):
                    totals["engine"] += cpu
                else:
                    totals["worker threads"] += cpu
        return totals


COMPONENTS = ("loop", "server threads", "worker loops", "worker threads", "engine")
ENGINE_THREADS = ("hibari",)
"""Kernel names (`/proc/.../comm`) of the engine's compute threads in a worker process."""


def threads(pid: int) -> list[tuple[int, str, float]]:
    """(thread id, kernel thread name, CPU seconds so far) of every thread of process `pid`."""
    found = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run_ns = int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                found.append((int(tid), name, run_ns / 1e9))
    return found


async def trial(server: CapacityServer, n: int, args: argparse.Namespace) -> Trial:
    result = Trial(n)
    compression = None if args.compression == "none" else "deflate"
    connect_limit = asyncio.Semaphore(32)

    async def connect(index: int) -> ClientConnection:
        # each session from its own loopback address, as distinct users are (the server caps sessions per address)
        source = f"127.0.{1 + index // 250}.{1 + index % 250}"
        async with connect_limit:
            ws = await websockets.connect(server.ws_url, max_size=None, compression=compression,
                                          ping_interval=None, local_addr=(source, 0))
            await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True,
                                      "split_granularity": "sentence"}))
            updated = json.loads(await ws.recv())
            if updated["type"] != "session.updated":
                raise RuntimeError(f"config refused: {updated}")
            return ws

    sockets = await asyncio.gather(*(connect(i) for i in range(n)))
    lag = _LoopLag()
    lag_task = asyncio.create_task(lag.run())
    rng = random.Random(args.seed * 1000 + n)
    start = time.monotonic() + 0.2
    stop = start + args.duration
    result.window = (start + args.ramp, stop)

    async def measure_window() -> None:
        """Server and client CPU over the steady window, where the load is what N sessions make."""
        lo, hi = result.window
        await asyncio.sleep(max(0.0, lo - time.monotonic()))
        server_before, client_before = server.cpu_seconds(), time.process_time()
        parts_before = server.components()
        await asyncio.sleep(max(0.0, hi - time.monotonic()))
        server_after, client_after = server.cpu_seconds(), time.process_time()
        parts_after = server.components()
        span = hi - lo
        result.components = {name: (parts_after[name] - parts_before[name]) / span for name in parts_after}
        result.server_loop_cpu = (server_after[0] - server_before[0]) / span
        result.server_other_cpu = (server_after[1] - server_before[1]) / span
        result.server_runq_wait = (server_after[2] - server_before[2]) / span
        result.client_cpu = (client_after - client_before) / span

    meter = asyncio.create_task(measure_window())
    try:
        await asyncio.gather(*(
            Session(ws, random.Random(rng.random()), args, result).run(start + rng.uniform(0, args.ramp), stop)
            for ws in sockets))
        await meter
    finally:
        meter.cancel()
        lag_task.cancel()
        result.client_lag_max_ms = lag.max_ms
        await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    return result


class _LoopLag:
    """How late this process's event loop wakes from a 10 ms sleep (a starved client misjudges arrivals)."""

    def __init__(self) -> None:
        self.max_ms = 0.0

    async def run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            self.max_ms = max(self.max_ms, (time.monotonic() - before - 0.01) * 1000.0)


FIGURES = {"stall_total_s": "{:.2f}", "ttfa_p50_ms": "{:.0f}", "ttfa_p95_ms": "{:.0f}", "streams_playing": "{:.1f}",
           "ceiling_rtf": "{:.1f}", "server_cpu_ms_per_audio_s": "{:.2f}", "server_loop_cpu": "{:.2f}",
           "server_other_cpu": "{:.2f}", "server_runq_wait": "{:.2f}", "client_cpu": "{:.2f}",
           "client_lag_max_ms": "{:.0f}"}
"""The figures of `Trial.summary` given per N as median [min-max] over rounds, and their format."""


@dataclass
class SearchResult:
    trials: list[Trial]
    rounds: int

    @property
    def max_sessions(self) -> int:
        """The largest N with zero underruns and no error in every round, as every smaller N tried had."""
        return held_every_round(self.passes(), self.rounds)

    def passes(self) -> dict[int, list[bool]]:
        """Each N tried: whether its trial passed, round by round."""
        passes: dict[int, list[bool]] = {}
        for trial in self.trials:
            passes.setdefault(trial.sessions, []).append(trial.passed)
        return passes

    @property
    def ceiling(self) -> float:
        """Median engine-only aggregate RTF over the runs before each trial."""
        return percentile([t.ceiling["aggregate_rtf"] for t in self.trials], 50)

    def at(self, sessions: int) -> list[Trial]:
        """The trials at N = `sessions`, one per round that ran it."""
        return [t for t in self.trials if t.sessions == sessions]

    def round_medians(self, figure: Callable[[Trial], float], passing_only: bool = True) -> list[float]:
        """Per round, the median of `figure` over that round's trials (passing ones only by default; a trial
        without the figure, nan, is left out; nan for a round with none)."""
        medians = []
        for round_ in range(self.rounds):
            mine = [t for t in self.trials if t.round == round_ and (t.passed or not passing_only)]
            medians.append(percentile([v for v in map(figure, mine) if not math.isnan(v)], 50))
        return medians

    def rows(self) -> list[list[object]]:
        """Per N, ascending: rounds run, pass and underruns per round, whether it passed in every round, and
        median [min-max] over rounds of each of `FIGURES`."""
        rows: list[list[object]] = []
        for n, passes in sorted(self.passes().items()):
            mine = self.at(n)
            held = len(passes) == self.rounds and all(passes)
            rows.append([n, len(mine), " ".join("yes" if p else "no" for p in passes),
                         " ".join(str(t.underruns) for t in mine), "yes" if held else "no",
                         *spreads([t.summary() for t in mine], FIGURES)])
        return rows

    def as_dict(self) -> dict[str, object]:
        return {"rounds": self.rounds, "ceiling_rtf_median": self.ceiling, "max_sessions": self.max_sessions,
                "passed_every_round": {n: len(p) == self.rounds and all(p) for n, p in self.passes().items()},
                "trials": [t.summary() for t in self.trials]}


async def search(args: argparse.Namespace) -> SearchResult:
    server_cpus = parse_cpus(args.server_cpus) or None
    client_cpus = parse_cpus(args.client_cpus) or None
    if client_cpus:
        pin_threads(client_cpus)
    ceiling = Ceiling(args.engine_workers, args.seed, server_cpus, client_cpus)
    await ceiling.engine.start()
    server = CapacityServer(args.engine_workers, args.engine_isolation, server_cpus, args.engine_processes)
    trials: list[Trial] = []

    async def run(n: int, round_: int) -> Trial:
        engine_only = await ceiling.measure(args.ceiling_s)
        result = await trial(server, n, args)
        result.ceiling = engine_only
        result.round = round_
        trials.append(result)
        s = result.summary()
        print(f"r{round_ + 1} ceiling {engine_only['aggregate_rtf']:5.1f} (runq wait {engine_only['runq_wait']:.2f})  "
                  f"N={n:4d} {'pass' if result.passed else 'FAIL'}  underruns {s['underruns']}  "
                  f"stall {s['stall_total_s']:.2f} s  ttfa p95 {s['ttfa_p95_ms']:.0f} ms  "
                  f"playing {s['streams_playing']:.1f}  server cpu loop {s['server_loop_cpu']:.2f} "
                  f"other {s['server_other_cpu']:.2f} runq wait {s['server_runq_wait']:.2f}  "
                  f"client cpu {s['client_cpu']:.2f}  lag {s['client_lag_max_ms']:.0f} ms  errors {s['errors']}  "
                  f"cpu ms per audio s: server {s['server_cpu_ms_per_audio_s']:.2f} "
                  f"engine-only {s['engine_cpu_ms_per_audio_s']:.2f}"
                  + "  by component: " + " ".join(f"{k} {v:.2f}" for k, v in result.component_ms().items())
                  + f"  unit margin ms p1/p5/p50: {result.margins()}"
                  + (f"  underruns at unit #: {result.underruns_by_unit()}" if result.underruns else ""),
                  flush=True)
        return result

    started = time.monotonic()
    spent = False

    def out_of_time() -> bool:
        """Whether `--budget-s` has run out (said once, when it first has)."""
        nonlocal spent
        if not spent and args.budget_s is not None and time.monotonic() - started > args.budget_s:
            spent = True
            print(f"budget of {args.budget_s:.0f} s spent: no more trials", flush=True)
        return spent

    try:
        await server.wait_ready()
        print(f"server pid {server.proc.pid} on port {server.port} (attach a profiler here)", flush=True)
        sessions = list(args.sessions)
        if args.fractions:
            first = (await ceiling.measure(args.ceiling_s))["aggregate_rtf"]
            sessions = sorted({max(1, round(f * first)) for f in args.fractions})
            print(f"engine-only ceiling before round 1: {first:.1f} real-time streams; fractions "
                  f"{', '.join(f'{f:.2f}' for f in args.fractions)} -> N = {', '.join(map(str, sessions))}", flush=True)
        for n in sessions:
            if out_of_time():
                break
            await run(n, 0)
        lo, hi, n = 0, None, args.start
        while not sessions and len(trials) < args.max_trials and not out_of_time():
            if (await run(n, 0)).passed:
                lo = n
            else:
                hi = n
            if hi is None:
                n *= 2
            elif hi - lo <= max(1, round(lo * args.resolution)):
                break
            else:
                n = (lo + hi) // 2
        for round_ in range(1, args.rounds):
            for n in sorted({t.sessions for t in trials if t.round == 0}):
                if out_of_time():
                    break
                await run(n, round_)
    finally:
        server.stop()
        await ceiling.engine.close()
    return SearchResult(trials, args.rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--engine-workers", type=int, default=2)
    parser.add_argument("--engine-isolation", choices=("process", "thread"), default="process",
                        help="the server's --engine-isolation (its default is process)")
    parser.add_argument("--engine-processes", type=int, default=None, metavar="P",
                        help="the server's --engine-processes (default: one process per worker)")
    parser.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[],
                        help="run one trial at each of these N (comma-separated) per round instead of searching")
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                        help="instead of --sessions: N = each of these fractions (comma-separated) of the engine-only "
                             "ceiling measured once before round 1, e.g. 0.75,0.8,0.85")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no trial after this many seconds from the server's start; what ran is reported")
    parser.add_argument("--rounds", type=int, default=3,
                        help="round 1 searches (or runs --sessions), later rounds rerun every N it ran")
    parser.add_argument("--start", type=int, default=16, help="first N; doubled until a trial fails")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds during which replies start")
    parser.add_argument("--ramp", type=float, default=4.0, help="session start times spread over this")
    parser.add_argument("--tokens-per-s", type=float, default=15.0)
    parser.add_argument("--gap", type=float, default=0.0,
                        help="mean pause between a reply's end of playback and the next reply's text")
    parser.add_argument("--compression", choices=("deflate", "none"), default="deflate",
                        help="permessage-deflate offered by the clients (browsers offer it)")
    parser.add_argument("--resolution", type=float, default=0.1, help="stop bisecting at this fraction of N")
    parser.add_argument("--max-trials", type=int, default=8, help="trials of the search (round 1)")
    parser.add_argument("--ceiling-s", type=float, default=5.0,
                        help="seconds of the engine-only run before each trial")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--server-cpus", default="",
                        help="pin the server and its engine processes (and the engine-only ceiling run) to these "
                             "cores, e.g. 0,1 or 0-1")
    parser.add_argument("--client-cpus", default="",
                        help="pin this process (the clients) to these cores, e.g. 2-3")
    parser.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    provenance = Provenance.begin()
    result = asyncio.run(search(args))
    provenance = provenance.end()
    if args.json:
        print(dump_json({"bench": "capacity", "provenance": provenance.as_dict(), "args": vars(args),
                         **result.as_dict()}))
        return 0
    ceiling = result.ceiling
    trials = [t.summary() for t in result.trials]
    print()
    print(provenance.line())
    print("each trial:")
    print(table(["round", "N", "pass", "replies", "units", "underruns", "stall s", "ttfa p50", "ttfa p95", "playing",
                 "ceiling", "loop cpu", "other cpu", "runq wait", "client cpu", "client lag ms"],
                [[t["round"] + 1, t["sessions"], t["passed"], t["replies"], t["units"], t["underruns"],
                  t["stall_total_s"], t["ttfa_p50_ms"], t["ttfa_p95_ms"], t["streams_playing"], t["ceiling_rtf"],
                  t["server_loop_cpu"], t["server_other_cpu"], t["server_runq_wait"], t["client_cpu"],
                  t["client_lag_max_ms"]]
                 for t in trials]))
    print("(ttfa in ms; playing: replies playing at once in the steady state, i.e. real-time streams served;\n"
          " ceiling: engine-only aggregate RTF measured just before the trial; cpu and run-queue wait in cores:\n"
          " server event-loop thread, other server threads and engine processes, their run-queue wait, this process;\n"
          " client lag: worst oversleep of this process's loop, which would misdate arrivals)")
    print()
    print(f"per N over {args.rounds} rounds: pass and underruns per round; passed: zero underruns in every round; "
          "the rest median [min-max] over rounds")
    print(table(["N", "rounds", "pass", "underruns", "passed", "stall s", "ttfa p50", "ttfa p95", "playing", "ceiling",
                 "server cpu ms/audio s", "loop cpu", "other cpu", "runq wait", "client cpu", "client lag ms"],
                result.rows()))
    print()
    print(f"engine ceiling (aggregate RTF, workers={args.engine_workers}; median [min-max] of the runs before the "
          f"trials): {spread([t['ceiling_rtf'] for t in trials], '{:.1f}')} real-time streams")
    n = result.max_sessions
    if n == 0:
        print("no N passed in every round")
        return 1
    at_n = [t.summary() for t in result.at(n)]
    print(f"largest N with zero underruns in every round: {n}  (p95 TTFA "
          f"{spread([s['ttfa_p95_ms'] for s in at_n])} ms, "
          f"{spread([s['streams_playing'] for s in at_n], '{:.1f}')} streams playing at once)")
    print(f"N / ceiling: {n / ceiling:.2f}  (target >= 0.80); streams playing / ceiling: "
          f"{spread([s['streams_playing'] / ceiling for s in at_n], '{:.2f}')}")
    server_cost = result.round_medians(lambda t: t.cpu_per_stream_ms)
    engine_cost = result.round_medians(lambda t: t.ceiling["cpu_ms_per_audio_s"], passing_only=False)
    efficiency = [e / s for e, s in zip(engine_cost, server_cost, strict=True)]
    print(f"CPU per second of audio (each round's median, then median [min-max] over rounds): server "
          f"{spread(server_cost, '{:.2f}')} ms (all threads, passing trials), engine alone "
          f"{spread(engine_cost, '{:.2f}')} ms; efficiency {spread(efficiency, '{:.2f}')} "
          "(the fraction of the ceiling a dedicated machine would reach if CPU were the only limit)")
    print_components(result, engine_cost)
    return 0


def print_components(result: SearchResult, engine_alone_ms: list[float]) -> None:
    """The server's CPU per second of audio by component (each round's median over its passing trials, then
    median [min-max] over rounds), and the serving path's own share: everything but the engine threads,
    plus what the engine threads spent beyond the engine alone (sharing cores, more and shorter units)."""
    per = {name: result.round_medians(_component(name)) for name in COMPONENTS}
    serving = [sum(per[name][r] for name in COMPONENTS if name != "engine") for r in range(result.rounds)]
    print("CPU ms per second of audio by component (each round's median of its passing trials, median [min-max] "
          "over rounds): " + ", ".join(f"{name} {spread(values, '{:.2f}')}" for name, values in per.items()))
    print(f"serving path (all but the engine threads): {spread(serving, '{:.2f}')} ms; engine threads "
          f"{spread(per['engine'], '{:.2f}')} ms against {spread(engine_alone_ms, '{:.2f}')} ms for the engine alone")


def _component(name: str) -> Callable[[Trial], float]:
    return lambda trial: trial.component_ms()[name]


if __name__ == "__main__":
    sys.exit(main())
