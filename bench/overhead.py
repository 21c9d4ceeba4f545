"""The serving path alone: real-time 24 kHz streams per core and added latency per unit, on the null engine.

Two servers run as separate processes pinned to the same core (`--server-cpu`, default 0); the clients run
here, pinned to the other core (`--client-cpu`, default 1):

- **voicewire**: `python -m voicewire.realtime --engine null` (instant audio: 60 ms of a tone per
  character, one piece per unit), uvloop, no auth;
- **baseline**: a raw aiohttp WebSocket server (`python -m bench.overhead --serve-baseline PORT`, uvloop)
  that speaks the same wire protocol with no pipeline behind it: it answers `session.config` with a
  `session.updated`, counts the characters of `input.text`, and on `input.done` sends the same frames
  voicewire sends (`audio.start` JSON, one binary frame of exactly as many pcm16 bytes, `audio.done`,
  `session.done`), slicing a precomputed tone.

Each session is one real-time stream, paced like playback: it sends one random sentence (`input.text`,
`split_granularity` none) and `input.done`, and sends the next sentence `--lead` seconds before the audio
it holds runs out. Audio plays from the first byte in real time; a reply whose first byte arrives after
the previous audio ran out is an underrun. Latency per unit: from sending `input.done` (the message that
completes the unit) to its first audio byte, which on the null engine is the whole serving path (receive,
decode, segment, schedule, render, send, loopback).

1. **Latency**: one session at a time, `--latency-reps` units per server in alternating blocks of 10, on an
   otherwise idle pair of servers: p50 and p99 of each and their ratio.
2. **Streams per core**: for each N in `--streams`, N sessions for `--duration` seconds against each
   server (alternating), with the server's CPU (all threads, /proc schedstat) over the steady window. A
   trial passes with no underrun, no error, p99 latency under `--lead` and the server below 0.95 of its
   core. It also gives the server's CPU milliseconds per second of audio streamed; 1000 divided by that
   is the number of streams a whole core would sustain if CPU were the only limit (the estimate to trust
   when the client, on one core of its own, runs out first: see its CPU column). The run-queue wait of
   the server's threads and of the client, per second of the window, says whether other processes held
   the cores: a trial that falls behind with low CPU and a high server wait was starved, not waiting on
   a timer or the network.

3. **Bursts** (`--burst`, default 64 and 128): N sessions per server, each holding a sentence, send
   `input.done` at the same moment, `--burst-reps` times after a warm-up: p50 and p95 from each send to its
   first audio byte, and voicewire's p95 less the baseline's. A burst is one event loop's worst moment (a
   voice agent's turns ending together; the talker bench starts every level so): the baseline sends the
   same frames with nothing behind them, so the difference is the serving path's work queued on the loop.

`--rounds` (default 3) repeats the three parts on the same servers (each round stops each server at its own first
failure). The report is median [min-max] over rounds of each round's figure, under a line naming the date,
the machine and the commit; an N counts as passed for a server only if it passed in every round, as did
every smaller N.

Run from the repository root: `python -m bench.overhead` (see `--help`; docs/benchmarks.md has results).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from aiohttp import WSMsgType, web

from bench.workload import (
    SENTENCES,
    Provenance,
    dump_json,
    held_every_round,
    percentile,
    schedstat,
    spread,
    spreads,
    stop_process,
    table,
)
from bench.workload import ServerProcess as Server
from tests.server import free_port

SAMPLE_RATE = 24000
BYTES_PER_SECOND = SAMPLE_RATE * 2
SECONDS_PER_CHAR = 0.06
"""The null engine's speech rate (adapters/null.py)."""


# -- the baseline server ----------------------------------------------------------------------------------


def baseline_app() -> web.Application:
    t = np.arange(SAMPLE_RATE * 20, dtype=np.float32) / SAMPLE_RATE
    tone = (0.05 * np.sin(2 * np.pi * 220.0 * t) * 32767).astype("<i2").tobytes()

    async def stream(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False, max_msg_size=4 * 1024 * 1024, heartbeat=20.0)
        await ws.prepare(request)
        chars = 0
        text = ""
        utterance = 0
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                break
            message = json.loads(msg.data)
            kind = message["type"]
            if kind == "session.config":
                await ws.send_str(json.dumps({"type": "session.updated", "session_id": "baseline"}))
            elif kind == "input.text":
                text += message["text"]
                chars += len(message["text"])
            elif kind == "input.done":
                n = int(chars * SECONDS_PER_CHAR * SAMPLE_RATE)
                audio_ms = round(n * 1000.0 / SAMPLE_RATE, 2)
                await ws.send_str(json.dumps({
                    "type": "audio.start", "utterance_index": utterance, "sentence_index": 0,
                    "sentence_text": text.strip(), "format": "pcm", "sample_rate": SAMPLE_RATE, "channels": 1}))
                await ws.send_bytes(tone[:2 * n])
                await ws.send_str(json.dumps({"type": "audio.done", "utterance_index": utterance, "sentence_index": 0,
                                              "total_bytes": 2 * n, "error": False, "audio_ms": audio_ms}))
                await ws.send_str(json.dumps({"type": "session.done", "utterance_index": utterance,
                                              "total_sentences": 1, "audio_ms": audio_ms,
                                              "timings": {"first_audio_ms": 0.0, "engine_ms": 0.0}}))
                utterance += 1
                chars = 0
                text = ""
        return ws

    app = web.Application()
    app.router.add_get("/v1/audio/speech/stream", stream)
    return app


class BaselineServer:
    """The baseline as its own process, with the accessors of the voicewire `Server` the bench uses."""

    def __init__(self, cpus: set[int]) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.overhead", "--serve-baseline", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        self.pid = self.proc.pid

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"

    def stop(self) -> None:
        stop_process(self.proc)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("baseline not ready")


# -- one stream -------------------------------------------------------------------------------------------


@dataclass
class Trial:
    server: str
    streams: int
    round: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    underruns: int = 0
    errors: list[str] = field(default_factory=list)
    audio_s: float = 0.0
    window_s: float = 0.0
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    server_wait: float = 0.0
    """Run-queue wait of the server's threads per second of the window: ready to run, but another process
    held the core (the machine is shared)."""
    client_wait: float = 0.0
    """The same for this (client) process."""

    @property
    def cpu_ms_per_audio_s(self) -> float:
        rate = self.audio_s / self.window_s if self.window_s else 0.0
        return self.server_cpu / rate * 1000.0 if rate else math.nan

    @property
    def streams_per_core(self) -> float:
        """1000 / `cpu_ms_per_audio_s`: the streams a whole core would sustain if CPU were the only limit."""
        return 1000.0 / self.cpu_ms_per_audio_s if self.cpu_ms_per_audio_s else math.nan

    def passed(self, lead_s: float) -> bool:
        return (not self.errors and self.underruns == 0 and bool(self.latencies_ms)
                and percentile(self.latencies_ms, 99) < lead_s * 1000.0 and self.server_cpu < 0.95)

    def figures(self) -> dict[str, float]:
        """The trial's figures that the report gives as median [min-max] over rounds (`TRIAL_FIGURES`)."""
        return {"lat_p50": percentile(self.latencies_ms, 50), "lat_p99": percentile(self.latencies_ms, 99),
                "audio_s_per_s": self.audio_s / self.window_s if self.window_s else 0.0,
                "server_cpu": self.server_cpu, "cpu_ms_per_audio_s": self.cpu_ms_per_audio_s,
                "streams_per_core": self.streams_per_core, "client_cpu": self.client_cpu,
                "server_wait": self.server_wait, "client_wait": self.client_wait}

    def row(self, lead_s: float) -> list[object]:
        return [self.round + 1, self.server, self.streams, "yes" if self.passed(lead_s) else "no",
                len(self.latencies_ms), self.underruns, len(self.errors), *self.figures().values()]


TRIAL_FIGURES = {"lat_p50": "{:.2f}", "lat_p99": "{:.2f}", "audio_s_per_s": "{:.0f}", "server_cpu": "{:.2f}",
                 "cpu_ms_per_audio_s": "{:.3f}", "streams_per_core": "{:.0f}", "client_cpu": "{:.2f}",
                 "server_wait": "{:.2f}", "client_wait": "{:.2f}"}
TRIAL_COLUMNS = ["lat p50", "lat p99", "audio s/s", "server cpu", "cpu ms/audio s", "streams/core est",
                 "client cpu", "server wait", "client wait"]


def trial_rows(trials: Sequence[Trial], lead_s: float) -> list[list[object]]:
    """Per server and N (in the order first run): the rounds that ran it, pass and underruns per round, and
    median [min-max] over those rounds of each of `TRIAL_FIGURES`."""
    groups: dict[tuple[str, int], list[Trial]] = {}
    for trial in trials:
        groups.setdefault((trial.server, trial.streams), []).append(trial)
    return [[server, n, len(mine), " ".join("yes" if t.passed(lead_s) else "no" for t in mine),
             " ".join(str(t.underruns) for t in mine), sum(len(t.errors) for t in mine),
             *spreads([t.figures() for t in mine], TRIAL_FIGURES)]
            for (server, n), mine in groups.items()]


def verdict(trials: Sequence[Trial], server: str, rounds: int, lead_s: float) -> str:
    """One server's result over rounds: the largest N that passed in every round (as did every smaller N),
    each round's largest N passed, and the CPU-bound streams per core (each round's median over its
    passing trials) as median [min-max] over rounds."""
    mine = [t for t in trials if t.server == server]
    passes: dict[int, list[bool]] = {}
    for trial in mine:
        passes.setdefault(trial.streams, []).append(trial.passed(lead_s))
    largest, estimates = [], []
    for round_ in range(rounds):
        passed = [t for t in mine if t.round == round_ and t.passed(lead_s)]
        largest.append(max((t.streams for t in passed), default=0))
        estimates.append(percentile([t.streams_per_core for t in passed], 50))
    return (f"{server}: largest N passed in every round {held_every_round(passes, rounds)} (per round: "
            f"{' '.join(map(str, largest))}); CPU-bound estimate {spread(estimates)} streams per core "
            "(each round's median of its passing trials)")


def latency_figures(lat: dict[str, list[float]]) -> dict[str, float]:
    """One round's idle latency: p50 and p99 of each server, and the serving path's addition (voicewire -
    baseline) and ratio at each."""
    figures = {f"{name} {q}": percentile(values, p) for name, values in lat.items()
               for q, p in (("p50", 50), ("p99", 99))}
    for q in ("p50", "p99"):
        figures[f"added {q}"] = figures[f"voicewire {q}"] - figures[f"baseline {q}"]
        figures[f"ratio {q}"] = figures[f"voicewire {q}"] / figures[f"baseline {q}"]
    return figures


class Stream:
    def __init__(self, index: int, url: str, rng: random.Random) -> None:
        self.source = f"127.2.{1 + index // 250 % 250}.{1 + index % 250}"
        self.url = url
        self.rng = rng
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    async def open(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(self.source, 0), limit=1))
        self.ws = await self.http.ws_connect(self.url, compress=0, autoping=True, max_msg_size=0)
        await self.ws.send_str(json.dumps({"type": "session.config", "response_format": "pcm",
                                           "stream_audio": True, "split_granularity": "none"}))
        updated = await self.ws.receive_json()
        if updated["type"] != "session.updated":
            raise RuntimeError(f"config refused: {updated}")

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.http is not None:
            await self.http.close()

    async def unit(self) -> tuple[float, float, float]:
        """Speak one sentence: (send time of input.done, first audio byte time, audio seconds)."""
        await self.say()
        return await self.done()

    async def say(self) -> None:
        """Send one random sentence's text (not yet `input.done`)."""
        assert self.ws is not None
        await self.ws.send_str(json.dumps({"type": "input.text", "text": self.rng.choice(SENTENCES)}))

    async def done(self) -> tuple[float, float, float]:
        """Send `input.done` and read the utterance: (its send time, first audio byte time, audio seconds)."""
        assert self.ws is not None
        sent = time.perf_counter()
        await self.ws.send_str('{"type":"input.done"}')
        first = 0.0
        nbytes = 0
        while True:
            msg = await self.ws.receive()
            if msg.type is WSMsgType.BINARY:
                if not first:
                    first = time.perf_counter()
                nbytes += len(msg.data)
            elif msg.type is WSMsgType.TEXT:
                event = json.loads(msg.data)
                if event["type"] == "session.done":
                    return sent, first, nbytes / BYTES_PER_SECOND
                if event["type"] == "error":
                    raise RuntimeError(f"error {event.get('code')}")
            else:
                raise RuntimeError(f"connection ended: {msg.type.name}")

    async def play(self, trial: Trial, start_at: float, window: tuple[float, float], lead_s: float) -> None:
        """Real-time playback until the window ends; counts what falls inside the window."""
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        plays_until = 0.0
        while time.perf_counter() < window[1]:
            try:
                sent, first, audio_s = await self.unit()
            except (RuntimeError, aiohttp.ClientError, OSError) as exc:
                trial.errors.append(str(exc))
                return
            counted = window[0] <= sent < window[1]
            if plays_until and first > plays_until and counted:
                trial.underruns += 1
            plays_until = max(plays_until, first) + audio_s
            if counted:
                trial.latencies_ms.append((first - sent) * 1000.0)
                trial.audio_s += audio_s
            await asyncio.sleep(max(0.0, plays_until - lead_s - time.perf_counter()))


async def run_trial(name: str, server: Server | BaselineServer, n: int, args: argparse.Namespace, seed: int,
                    round_: int) -> Trial:
    trial = Trial(name, n, round_)
    rng = random.Random(seed)
    streams = [Stream(i, server.ws_url, random.Random(rng.random())) for i in range(n)]
    limit = asyncio.Semaphore(64)

    async def open_one(stream: Stream) -> None:
        async with limit:
            await stream.open()

    try:
        await asyncio.gather(*(open_one(s) for s in streams))
        start = time.perf_counter() + 0.1
        window = (start + args.ramp + 1.0, start + args.ramp + 1.0 + args.duration)
        trial.window_s = args.duration

        async def meter() -> None:
            await asyncio.sleep(max(0.0, window[0] - time.perf_counter()))
            server_before, client_before = schedstat(server.pid), time.process_time()
            client_wait_before = schedstat(os.getpid())[2]
            await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
            server_after = schedstat(server.pid)
            trial.server_cpu = (sum(server_after[:2]) - sum(server_before[:2])) / args.duration
            trial.server_wait = (server_after[2] - server_before[2]) / args.duration
            trial.client_cpu = (time.process_time() - client_before) / args.duration
            trial.client_wait = (schedstat(os.getpid())[2] - client_wait_before) / args.duration

        await asyncio.gather(meter(), *(s.play(trial, start + rng.uniform(0, args.ramp), window, args.lead)
                                        for s in streams))
    finally:
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
    return trial


async def latency(servers: dict[str, Server | BaselineServer], reps: int, seed: int) -> dict[str, list[float]]:
    """Idle latency: one session per server, alternating blocks of 10 units, no pacing."""
    result: dict[str, list[float]] = {name: [] for name in servers}
    streams = {name: Stream(i, server.ws_url, random.Random(seed)) for i, (name, server) in enumerate(servers.items())}
    try:
        for stream in streams.values():
            await stream.open()
        for _ in range(5):  # warm-up
            for stream in streams.values():
                await stream.unit()
        for _ in range(max(1, reps // 10)):
            for name, stream in streams.items():
                for _ in range(10):
                    sent, first, _ = await stream.unit()
                    result[name].append((first - sent) * 1000.0)
                    await asyncio.sleep(0.005)
    finally:
        for stream in streams.values():
            await stream.close()
    return result


async def burst(servers: dict[str, Server | BaselineServer], sizes: Sequence[int], reps: int,
                seed: int) -> dict[str, dict[int, list[float]]]:
    """Synchronized bursts: per N and server, N sessions each holding a sentence send `input.done` at the same
    moment, `reps` times after one warm-up; the ms from each send to its first audio byte. What one event loop
    does for N sessions at once (a voice agent's turn ending on many sessions together, the talker bench's
    start), against the baseline's minimum for the same frames."""
    result: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in servers}
    limit = asyncio.Semaphore(64)

    async def open_one(stream: Stream) -> None:
        async with limit:
            await stream.open()

    for n in sizes:
        for name, server in servers.items():
            streams = [Stream(i, server.ws_url, random.Random(seed + i)) for i in range(n)]
            try:
                await asyncio.gather(*(open_one(s) for s in streams))
                for rep in range(reps + 1):
                    await asyncio.gather(*(s.say() for s in streams))
                    await asyncio.sleep(0.2)  # every sentence is in before the burst
                    got = await asyncio.gather(*(s.done() for s in streams))
                    if rep:
                        result[name][n] += [(first - sent) * 1000.0 for sent, first, _ in got]
            finally:
                await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
    return result


def burst_figures(got: dict[str, dict[int, list[float]]]) -> dict[str, float]:
    """One round's burst figures: per server and N, p50 and p95 ms; per N, voicewire's p95 less the baseline's."""
    figures = {f"{name} {n} p{q}": percentile(values, q) for name, by_n in got.items()
               for n, values in by_n.items() for q in (50, 95)}
    for n in got["voicewire"]:
        figures[f"added {n} p95"] = figures[f"voicewire {n} p95"] - figures[f"baseline {n} p95"]
    return figures


Round = tuple[dict[str, list[float]], list[Trial], dict[str, dict[int, list[float]]]]
"""One round of the bench: idle latency per server, the stream trials, the bursts per server and N."""


async def bench(args: argparse.Namespace) -> list[Round]:
    """Each round's idle latency, trials and bursts, on one pair of servers."""
    os.sched_setaffinity(0, {args.client_cpu})
    cpus = {args.server_cpu}
    servers: dict[str, Server | BaselineServer] = {"voicewire": Server("null", 100000, cpus=cpus),
                                                   "baseline": BaselineServer(cpus)}
    try:
        for server in servers.values():
            await server.wait_ready()
        print(f"servers on cpu {args.server_cpu}: " + ", ".join(f"{k} pid {s.pid}" for k, s in servers.items())
              + f"; clients on cpu {args.client_cpu}", flush=True)
        rounds = []
        for round_ in range(args.rounds):
            seed = args.seed + 1000 * round_
            lat = await latency(servers, args.latency_reps, seed)
            for name, values in lat.items():
                print(f"round {round_ + 1} idle latency {name}: p50 {percentile(values, 50):.3f} ms  "
                      f"p99 {percentile(values, 99):.3f} ms", flush=True)
            trials: list[Trial] = []
            failed: set[str] = set()
            for n in args.streams:
                for name, server in servers.items():
                    if name in failed:
                        continue
                    trial = await run_trial(name, server, n, args, seed + n, round_)
                    trials.append(trial)
                    print("  ".join(str(round(v, 2) if isinstance(v, float) else v) for v in trial.row(args.lead)),
                          flush=True)
                    if not trial.passed(args.lead):
                        failed.add(name)
                if len(failed) == len(servers):
                    break
            bursts = await burst(servers, args.burst, args.burst_reps, seed) if args.burst else {}
            for name, by_n in bursts.items():
                for n, values in by_n.items():
                    print(f"round {round_ + 1} burst of {n} {name}: p50 {percentile(values, 50):.1f} ms  "
                          f"p95 {percentile(values, 95):.1f} ms", flush=True)
            rounds.append((lat, trials, bursts))
    finally:
        for server in servers.values():
            server.stop()
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[250, 500, 1000, 2000],
                        help="comma-separated N to try, in order (each server stops at its first failure)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of the measured window per trial")
    parser.add_argument("--ramp", type=float, default=3.0, help="stream start times spread over this")
    parser.add_argument("--lead", type=float, default=0.3,
                        help="a stream asks for its next sentence this many seconds before its audio runs out")
    parser.add_argument("--latency-reps", type=int, default=200, help="idle units timed per server and round")
    parser.add_argument("--rounds", type=int, default=3, help="runs of both parts, reported as median [min-max]")
    parser.add_argument("--burst", type=lambda s: [int(x) for x in s.split(",") if x], default=[64, 128],
                        help="comma-separated N of the synchronized bursts (empty: none)")
    parser.add_argument("--burst-reps", type=int, default=5, help="bursts timed per N, server and round")
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--client-cpu", type=int, default=1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    parser.add_argument("--serve-baseline", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if args.serve_baseline:
        web.run_app(baseline_app(), host="127.0.0.1", port=args.serve_baseline, print=None)
        return 0
    provenance = Provenance.begin()
    rounds = asyncio.run(bench(args))
    provenance = provenance.end()
    trials = [t for _, mine, _ in rounds for t in mine]
    latencies = [latency_figures(lat) for lat, _, _ in rounds]
    print()
    print(provenance.line())
    print(f"overhead: server and baseline on cpu {args.server_cpu}, clients on cpu {args.client_cpu}, null engine, "
          f"pcm 24 kHz, lead {args.lead:g} s; median [min-max] over {args.rounds} rounds of each round's figure")
    print(table(["server", "units per round", "p50 ms", "p99 ms"],
                [[name, len(values), *spreads(latencies, {f"{name} p50": "{:.3f}", f"{name} p99": "{:.3f}"})]
                 for name, values in rounds[0][0].items()]))
    added = spreads(latencies, {"added p50": "{:.3f}", "added p99": "{:.3f}", "ratio p50": "{:.2f}",
                                "ratio p99": "{:.2f}"})
    print(f"serving path added per unit (voicewire - baseline): p50 {added[0]} ms, p99 {added[1]} ms; "
          f"ratio p50 {added[2]}, p99 {added[3]}")
    print()
    print("each trial:")
    print(table(["round", "server", "N", "pass", "units", "underruns", "errors", *TRIAL_COLUMNS],
                [t.row(args.lead) for t in trials]))
    print()
    print("per server and N: pass and underruns per round, the rest median [min-max] over the rounds that ran it")
    print(table(["server", "N", "rounds", "pass", "underruns", "errors", *TRIAL_COLUMNS],
                trial_rows(trials, args.lead)))
    for name in ("voicewire", "baseline"):
        print(verdict(trials, name, args.rounds, args.lead))
    if args.burst:
        bursts = [burst_figures(got) for _, _, got in rounds]
        print()
        print(f"synchronized bursts ({args.burst_reps} per N, server and round): ms from input.done to the first "
              "audio byte, median [min-max] over rounds of each round's figure")
        print(table(["N", "voicewire p50", "voicewire p95", "baseline p50", "baseline p95", "added p95"],
                    [[n, *spreads(bursts, {f"voicewire {n} p50": "{:.1f}", f"voicewire {n} p95": "{:.1f}",
                                           f"baseline {n} p50": "{:.1f}", f"baseline {n} p95": "{:.1f}",
                                           f"added {n} p95": "{:.1f}"})] for n in args.burst]))
    if args.json:
        print(dump_json({"bench": "overhead", "provenance": provenance.as_dict(), "args": vars(args),
                         "rounds": [{"latency_ms": lat,
                                     "trials": [{**vars(t), "passed": t.passed(args.lead)} for t in mine],
                                     "burst_ms": {name: {str(n): v for n, v in by_n.items()}
                                                  for name, by_n in got.items()}}
                                    for lat, mine, got in rounds]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
