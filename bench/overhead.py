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
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from aiohttp import WSMsgType, web

from bench.workload import SENTENCES, dump_json, percentile, schedstat, stop_process, table
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

    def passed(self, lead_s: float) -> bool:
        return (not self.errors and self.underruns == 0 and bool(self.latencies_ms)
                and percentile(self.latencies_ms, 99) < lead_s * 1000.0 and self.server_cpu < 0.95)

    def row(self, lead_s: float) -> list[object]:
        return [self.server, self.streams, "yes" if self.passed(lead_s) else "no", len(self.latencies_ms),
                self.underruns, len(self.errors), percentile(self.latencies_ms, 50),
                percentile(self.latencies_ms, 99), self.audio_s / self.window_s if self.window_s else 0.0,
                self.server_cpu, self.cpu_ms_per_audio_s, 1000.0 / self.cpu_ms_per_audio_s, self.client_cpu,
                self.server_wait, self.client_wait]


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
        assert self.ws is not None
        await self.ws.send_str(json.dumps({"type": "input.text", "text": self.rng.choice(SENTENCES)}))
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


async def run_trial(name: str, server: Server | BaselineServer, n: int, args: argparse.Namespace, seed: int) -> Trial:
    trial = Trial(name, n)
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


async def bench(args: argparse.Namespace) -> dict[str, object]:
    os.sched_setaffinity(0, {args.client_cpu})
    cpus = {args.server_cpu}
    servers: dict[str, Server | BaselineServer] = {"voicewire": Server("null", 100000, cpus=cpus),
                                                   "baseline": BaselineServer(cpus)}
    try:
        for server in servers.values():
            await server.wait_ready()
        print(f"servers on cpu {args.server_cpu}: " + ", ".join(f"{k} pid {s.pid}" for k, s in servers.items())
              + f"; clients on cpu {args.client_cpu}", flush=True)
        lat = await latency(servers, args.latency_reps, args.seed)
        for name, values in lat.items():
            print(f"idle latency {name}: p50 {percentile(values, 50):.3f} ms  p99 {percentile(values, 99):.3f} ms",
                  flush=True)
        trials: list[Trial] = []
        failed: set[str] = set()
        for n in args.streams:
            for name, server in servers.items():
                if name in failed:
                    continue
                trial = await run_trial(name, server, n, args, args.seed + n)
                trials.append(trial)
                print("  ".join(str(round(v, 2) if isinstance(v, float) else v) for v in trial.row(args.lead)),
                      flush=True)
                if not trial.passed(args.lead):
                    failed.add(name)
            if len(failed) == len(servers):
                break
    finally:
        for server in servers.values():
            server.stop()
    return {"latency_ms": lat, "trials": trials}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[250, 500, 1000, 2000],
                        help="comma-separated N to try, in order (each server stops at its first failure)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of the measured window per trial")
    parser.add_argument("--ramp", type=float, default=3.0, help="stream start times spread over this")
    parser.add_argument("--lead", type=float, default=0.3,
                        help="a stream asks for its next sentence this many seconds before its audio runs out")
    parser.add_argument("--latency-reps", type=int, default=200, help="idle units timed per server")
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
    result = asyncio.run(bench(args))
    lat = result["latency_ms"]
    trials = result["trials"]
    assert isinstance(lat, dict) and isinstance(trials, list)
    ours, base = lat["voicewire"], lat["baseline"]
    print(f"\noverhead: server and baseline on cpu {args.server_cpu}, clients on cpu {args.client_cpu}, null engine, "
          f"pcm 24 kHz, lead {args.lead:g} s")
    print(table(["server", "units", "p50 ms", "p99 ms"],
                [[name, len(v), percentile(v, 50), percentile(v, 99)] for name, v in lat.items()]))
    print("serving path added per unit (voicewire - baseline): "
          f"p50 {percentile(ours, 50) - percentile(base, 50):.3f} ms, "
          f"p99 {percentile(ours, 99) - percentile(base, 99):.3f} ms; ratio p50 "
          f"{percentile(ours, 50) / percentile(base, 50):.2f}, p99 {percentile(ours, 99) / percentile(base, 99):.2f}")
    print()
    print(table(["server", "N", "pass", "units", "underruns", "errors", "lat p50", "lat p99", "audio s/s",
                 "server cpu", "cpu ms/audio s", "streams/core est", "client cpu", "server wait", "client wait"],
                [t.row(args.lead) for t in trials]))
    for name in ("voicewire", "baseline"):
        mine = [t for t in trials if t.server == name]
        passed = [t.streams for t in mine if t.passed(args.lead)]
        best = max(passed, default=0)
        est = percentile([1000.0 / t.cpu_ms_per_audio_s for t in mine if t.passed(args.lead)], 50)
        print(f"{name}: largest N passed {best}; CPU-bound estimate {est:.0f} streams per core (median of passing "
              "trials)")
    if args.json:
        print(dump_json({"bench": "overhead", "args": vars(args), "latency_ms": lat,
                         "trials": [{**vars(t), "passed": t.passed(args.lead)} for t in trials]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
