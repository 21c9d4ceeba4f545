"""Soak: hundreds of sessions connecting, speaking, cancelling and disconnecting for minutes; the server's
RSS, open file descriptors, threads and event-loop tasks must stay flat and unexpected errors at zero.

The server runs as its own process (`python -m voicewire.realtime --engine E --no-auth --max-sessions N`,
uvloop). This process runs `--sessions` client slots, each one asyncio task over the real `websockets`
library from its own loopback address (the server caps sessions per address). A slot loops: connect,
`session.config` (streamed pcm, `sentence` split), 1-4 behaviours with think time between them, then a
clean `session.close` (or none, when the behaviour ended the connection), think, reconnect. Behaviours
(weights with `--mix`):

- `normal`: a 1-3 sentence reply as deltas of 4-40 characters, `input.done`, read to `session.done`;
- `barge_in`: stream two sentences, leave the utterance open, `input.cancel` at the first audio byte,
  read to `audio.cancelled` (the user interrupts while the LLM is still talking);
- `disconnect`: a 3-6 sentence reply, abort the TCP connection at the first audio byte (no close frame);
- `slow_reader`: a 2-4 sentence reply read with a 0.1-0.6 s pause before every frame;
- `bad_messages`: 2-4 of invalid JSON, an unknown type, a binary frame, a wrong field type, an invalid
  reconfig, an oversized frame; each must get its own non-fatal `error`, then a `normal` reply must work;
- `stall`: a 60-sentence reply, stop reading at the first audio byte for `--stall-hold` seconds (past the
  server's 15 s stall timeout), then read on: the server must have closed the connection (1006 or 1008).
  Client sockets get a small receive buffer (`--client-rcvbuf`) so the server's sends block soon; a reply
  that still fit in the buffers ends with `session.done`, and one still streaming 10 s after the hold (a
  slow engine had not filled the buffers yet) is aborted by the client: both count as "stall not
  detected" (expected), not as errors.

Every `--sample-s` the bench samples the server process: RSS (VmRSS, and its engine worker processes'
separately), open file descriptors (/proc/PID/fd), threads, and from `/metrics` the sessions open, the
event loop's task count (`voicewire_event_loop_tasks`) and errors by code. It reports an idle sample
before the load, the first sample after `--warmup` seconds, the last one under load, an idle sample after
every client has gone, and each metric's least-squares drift per minute after warm-up. Client-side
errors are split into expected (the bad messages' codes, the stall close) and unexpected (everything
else: must be zero). The server's log lines at WARNING or above are counted by message.

Run from the repository root: `python -m bench.soak --engine null` (see `--help`; docs/benchmarks.md
has results).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import websockets
from websockets.asyncio.client import ClientConnection

from bench.workload import SENTENCES, ServerProcess, children, dump_json, table, utterance

BEHAVIOURS = ("normal", "barge_in", "disconnect", "slow_reader", "bad_messages", "stall")
DEFAULT_MIX = "normal=50,barge_in=15,disconnect=10,slow_reader=10,bad_messages=12,stall=3"
DEFAULT_THINK = {"null": (0.5, 3.0), "hibari": (8.0, 20.0)}
"""Seconds between behaviours: the embedded engine on 2 cores sustains far fewer streams than null."""
REPLY_TIMEOUT_S = 120.0
STALL_READ_S = 10.0
"""After its hold, a stalled client reads this long for the server's close (or the reply's end)."""
BAD_MESSAGES: tuple[tuple[str, str | bytes], ...] = (
    ("invalid_json", "{not json"),
    ("unknown_type", json.dumps({"type": "input.nope"})),
    ("binary_not_supported", b"\x00\x01binary"),
    ("invalid_text", json.dumps({"type": "input.text", "text": 5})),
    ("invalid_config", json.dumps({"type": "session.config", "speed": 99})),
    ("message_too_large", json.dumps({"type": "input.text", "text": "a" * (129 * 1024)})),
)
METRIC_LINE = re.compile(r'^(voicewire_[a-z_]+?)(?:_total)?(?:\{code="([^"]*)"\})? ([0-9.e+-]+)$')


class Unexpected(Exception):
    """Something a healthy server would not do; counted by its text, never raised past a slot."""


@dataclass
class Tally:
    started: collections.Counter[str] = field(default_factory=collections.Counter)
    completed: collections.Counter[str] = field(default_factory=collections.Counter)
    expected: collections.Counter[str] = field(default_factory=collections.Counter)
    """Error codes and close codes the behaviour asked for."""
    unexpected: collections.Counter[str] = field(default_factory=collections.Counter)
    close_codes: collections.Counter[str] = field(default_factory=collections.Counter)
    connections: int = 0
    audio_bytes: int = 0


@dataclass
class Sample:
    t: float
    rss_mb: float
    workers_rss_mb: float
    fds: int
    threads: int
    sessions_open: float
    tasks: float


# -- the server -------------------------------------------------------------------------------------------


class Server(ServerProcess):
    """The soak's server: a `ServerProcess` whose log is searched for problems afterwards."""

    def log_problems(self) -> collections.Counter[str]:
        """Log lines at WARNING or above, by logger and message with digits and ids blurred."""
        found: collections.Counter[str] = collections.Counter()
        for line in Path(self.log.name).read_text(errors="replace").splitlines():
            match = re.match(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) (\S+): (.*)$", line)
            if match:
                text = re.sub(r"sess_\w+|\d+(\.\d+)?", "#", match.group(3))[:100]
                found[f"{match.group(1)} {match.group(2)}: {text}"] += 1
            elif line.startswith("Traceback"):
                found["Traceback"] += 1
        return found


def proc_status(pid: int) -> tuple[float, int]:
    """(VmRSS MB, threads) of `pid`."""
    rss = 0.0
    threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024.0
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


async def scrape(http: aiohttp.ClientSession, server: Server) -> dict[str, float]:
    """The server's `voicewire_*` metrics; errors as `errors:CODE`."""
    async with http.get(f"{server.http_url}/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if match is None:
            continue
        name, code, value = match.groups()
        if name == "voicewire_errors" and code is not None:
            values[f"errors:{code}"] = float(value)
        elif code is None:
            values[name] = float(value)
    return values


async def sample(http: aiohttp.ClientSession, server: Server, t0: float) -> tuple[Sample, dict[str, float]]:
    metrics = await scrape(http, server)
    rss, threads = proc_status(server.pid)
    workers = 0.0
    for child in children(server.pid):
        with contextlib.suppress(OSError):
            workers += proc_status(child)[0]
    fds = len(os.listdir(f"/proc/{server.pid}/fd"))
    return Sample(time.monotonic() - t0, rss, workers, fds, threads, metrics.get("voicewire_sessions_open", -1.0),
                  metrics.get("voicewire_event_loop_tasks", -1.0)), metrics


async def wait_idle(http: aiohttp.ClientSession, server: Server, timeout: float) -> None:
    """Until the server reports no open session (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await scrape(http, server)).get("voicewire_sessions_open", 0.0) == 0.0:
            return
        await asyncio.sleep(0.5)


# -- one client slot --------------------------------------------------------------------------------------


class Slot:
    def __init__(self, index: int, url: str, rng: random.Random, args: argparse.Namespace, tally: Tally) -> None:
        self.source = f"127.{1 + index // 62500}.{1 + index // 250 % 250}.{1 + index % 250}"
        self.url = url
        self.port = int(url.split(":")[2].split("/")[0])
        self.rng = rng
        self.args = args
        self.tally = tally
        self.weights = args.weights

    async def run(self, start_at: float, stop_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < stop_at:
            try:
                await self.session(stop_at)
            except Unexpected as exc:
                self.tally.unexpected[str(exc)] += 1
            except (websockets.ConnectionClosed, OSError, TimeoutError) as exc:
                self.tally.unexpected[f"{type(exc).__name__}: {exc}"[:120]] += 1
            await self.think()

    async def think(self) -> None:
        await asyncio.sleep(self.rng.uniform(*self.args.think))

    async def session(self, stop_at: float) -> None:
        # a small receive buffer, so a client that stops reading stalls the server's sends within a few frames
        # (kernel autotuning would otherwise let megabytes of audio pile up on the server's side first)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.args.client_rcvbuf)
        sock.bind((self.source, 0))
        sock.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port)), 60)
        except BaseException:
            sock.close()
            raise
        ws = await websockets.connect(self.url, sock=sock, max_size=None, ping_interval=None, max_queue=4,
                                      open_timeout=60, close_timeout=10)
        self.tally.connections += 1
        try:
            await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True,
                                      "split_granularity": "sentence"}))
            first = json.loads(await asyncio.wait_for(ws.recv(), REPLY_TIMEOUT_S))
            if first["type"] != "session.updated":
                raise Unexpected(f"config: {first.get('code', first['type'])}")
            for turn in range(self.rng.randint(1, 4)):
                if turn:
                    await self.think()
                if time.monotonic() >= stop_at:
                    break
                kind = self.rng.choices(BEHAVIOURS, self.weights)[0]
                self.tally.started[kind] += 1
                open_after = await getattr(self, kind)(ws)
                self.tally.completed[kind] += 1
                if not open_after:
                    return
            await ws.send(json.dumps({"type": "session.close"}))
            await self.read_to_close(ws)
            code = ws.close_code
            if code != 1000:
                raise Unexpected(f"session.close answered with close code {code}")
            self.tally.close_codes[str(code)] += 1
        finally:
            if ws.transport is not None and not ws.transport.is_closing():
                ws.transport.abort()

    # -- reading ------------------------------------------------------------------------------------------

    async def until(self, ws: ClientConnection, kinds: set[str], *, pause: tuple[float, float] | None = None,
                    expect_errors: int = 0) -> tuple[str, list[str]]:
        """Read until an event of one of `kinds` (or the first audio frame for "<binary>"); returns its type
        and the codes of the `error` events seen meanwhile (only `expect_errors` of them are allowed)."""
        codes: list[str] = []
        async with asyncio.timeout(REPLY_TIMEOUT_S):
            while True:
                if pause is not None:
                    await asyncio.sleep(self.rng.uniform(*pause))
                frame = await ws.recv()
                if isinstance(frame, bytes):
                    self.tally.audio_bytes += len(frame)
                    if "<binary>" in kinds:
                        return "<binary>", codes
                    continue
                event = json.loads(frame)
                kind = event["type"]
                if kind == "error":
                    codes.append(str(event.get("code")))
                    if len(codes) > expect_errors or event.get("fatal"):
                        raise Unexpected(f"error event {event.get('code')}: {str(event.get('message'))[:60]}")
                if kind in kinds:
                    return kind, codes

    async def read_to_close(self, ws: ClientConnection, until: str | None = None,
                            timeout: float = REPLY_TIMEOUT_S) -> bool:
        """Read until the connection closes (False) or an event of type `until` arrives (True)."""
        with contextlib.suppress(websockets.ConnectionClosed):
            async with asyncio.timeout(timeout):
                while True:
                    frame = await ws.recv()
                    if isinstance(frame, bytes):
                        self.tally.audio_bytes += len(frame)
                    elif until is not None and json.loads(frame)["type"] == until:
                        return True
        return False

    async def speak(self, ws: ClientConnection, text: str, done: bool = True) -> None:
        position = 0
        while position < len(text):
            size = self.rng.randint(4, 40)
            await ws.send(json.dumps({"type": "input.text", "text": text[position:position + size]}))
            position += size
        if done:
            await ws.send(json.dumps({"type": "input.done"}))

    # -- behaviours: each returns whether the connection is still open --------------------------------------

    async def normal(self, ws: ClientConnection) -> bool:
        await self.speak(ws, utterance(self.rng, self.rng.randint(1, 3)))
        await self.until(ws, {"session.done"})
        return True

    async def barge_in(self, ws: ClientConnection) -> bool:
        await self.speak(ws, utterance(self.rng, 2), done=False)
        await self.until(ws, {"<binary>"})
        await ws.send(json.dumps({"type": "input.cancel"}))
        await self.until(ws, {"audio.cancelled"})
        return True

    async def disconnect(self, ws: ClientConnection) -> bool:
        await self.speak(ws, utterance(self.rng, self.rng.randint(3, 6)))
        await self.until(ws, {"<binary>"})
        assert ws.transport is not None
        ws.transport.abort()
        self.tally.close_codes["abort"] += 1
        return False

    async def slow_reader(self, ws: ClientConnection) -> bool:
        await self.speak(ws, utterance(self.rng, self.rng.randint(2, 4)))
        await self.until(ws, {"session.done"}, pause=(0.1, 0.6))
        return True

    async def bad_messages(self, ws: ClientConnection) -> bool:
        chosen = self.rng.sample(BAD_MESSAGES, self.rng.randint(2, 4))
        for _, message in chosen:
            await ws.send(message)
        codes: list[str] = []
        for _ in chosen:
            codes += (await self.until(ws, {"error"}, expect_errors=len(chosen)))[1]
        if sorted(codes) != sorted(code for code, _ in chosen):
            raise Unexpected(f"bad messages answered with {sorted(codes)}, not {sorted(c for c, _ in chosen)}")
        for code in codes:
            self.tally.expected[code] += 1
        return await self.normal(ws)

    async def stall(self, ws: ClientConnection) -> bool:
        text = " ".join(self.rng.choice(SENTENCES) for _ in range(60))  # ~200 s of audio: more than buffers hold
        await self.speak(ws, text)
        await self.until(ws, {"<binary>"})
        await asyncio.sleep(self.args.stall_hold)
        try:
            if await self.read_to_close(ws, until="session.done", timeout=STALL_READ_S):
                self.tally.expected["stall not detected: the reply fit in the socket buffers"] += 1
                return True
        except TimeoutError:
            # still streaming: a slow engine (hibari under load) had not filled the buffers during the hold
            self.tally.expected["stall not detected: the engine had not filled the buffers yet"] += 1
            assert ws.transport is not None
            ws.transport.abort()
            return False
        code = ws.close_code
        self.tally.close_codes[str(code)] += 1
        # 1006: the server reset the connection (it drops unsent bytes of a client that stopped reading);
        # 1008: its close frame got through first
        if code in (1006, 1008):
            self.tally.expected["server closed the stalled client"] += 1
            return False
        raise Unexpected(f"a client that stopped reading for {self.args.stall_hold:g} s was closed with "
                         f"{code}, not 1006/1008")


# -- the run ----------------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    engine: str
    samples: list[Sample]
    idle_before: Sample
    warm: Sample
    loaded_end: Sample
    idle_after: Sample
    drift_per_min: dict[str, float]
    tally: Tally
    server_errors: dict[str, float]
    server_log: dict[str, int]
    minutes: float

    @property
    def leak_free(self) -> bool:
        b, a = self.idle_before, self.idle_after
        return (a.fds == b.fds and a.threads <= self.warm.threads and a.tasks == b.tasks
                and a.sessions_open == 0 and not self.tally.unexpected)

    def as_dict(self) -> dict[str, Any]:
        t = self.tally
        return {
            "engine": self.engine, "minutes": self.minutes, "leak_free": self.leak_free,
            "idle_before": asdict(self.idle_before), "warm": asdict(self.warm), "loaded_end": asdict(self.loaded_end),
            "idle_after": asdict(self.idle_after), "drift_per_min": self.drift_per_min,
            "connections": t.connections, "audio_mb": t.audio_bytes / 1e6, "started": dict(t.started),
            "completed": dict(t.completed), "expected": dict(t.expected), "unexpected": dict(t.unexpected),
            "close_codes": dict(t.close_codes), "server_errors": self.server_errors, "server_log": self.server_log,
            "samples": [asdict(s) for s in self.samples],
        }


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 60.0 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")


async def soak(args: argparse.Namespace) -> SoakResult:
    extra = ["--engine-workers", str(args.engine_workers)]
    server = Server(args.engine, args.sessions + 16, extra)
    tally = Tally()
    samples: list[Sample] = []
    try:
        await server.wait_ready()
        print(f"server pid {server.pid} on port {server.port}, log {server.log.name}", flush=True)
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            idle_before, _ = await sample(http, server, t0)
            stop_at = t0 + args.duration
            rng = random.Random(args.seed)
            slots = [Slot(i, server.ws_url, random.Random(rng.random()), args, tally) for i in range(args.sessions)]
            runs = asyncio.gather(*(s.run(t0 + rng.uniform(0, args.ramp), stop_at) for s in slots))
            next_print = t0
            while time.monotonic() < stop_at:
                await asyncio.sleep(args.sample_s)
                s, metrics = await sample(http, server, t0)
                samples.append(s)
                if time.monotonic() >= next_print:
                    next_print += 30.0
                    print(f"t={s.t:5.0f}s rss {s.rss_mb:6.1f} MB (workers {s.workers_rss_mb:6.1f})  fds {s.fds:4d}  "
                          f"threads {s.threads:3d}  sessions {s.sessions_open:4.0f}  tasks {s.tasks:5.0f}  "
                          f"connections {tally.connections}  unexpected {sum(tally.unexpected.values())}",
                          flush=True)
            try:
                await asyncio.wait_for(runs, args.stall_hold + REPLY_TIMEOUT_S)
            except TimeoutError:
                tally.unexpected["client slot still busy long after the end"] += 1
            await wait_idle(http, server, 30.0)
            await asyncio.sleep(2.0)
            idle_after, metrics = await sample(http, server, t0)
    finally:
        server.stop()
    loaded = [s for s in samples if s.t >= args.warmup]
    drift = {name: slope_per_min([(s.t, float(getattr(s, name))) for s in loaded])
             for name in ("rss_mb", "workers_rss_mb", "fds", "threads", "tasks", "sessions_open")}
    errors = {k.split(":", 1)[1]: v for k, v in metrics.items() if k.startswith("errors:")}
    return SoakResult(args.engine, samples, idle_before, loaded[0] if loaded else samples[0],
                      samples[-1], idle_after, drift, tally, errors, dict(server.log_problems()),
                      args.duration / 60.0)


def report(result: SoakResult) -> str:
    t = result.tally
    rows = []
    for name, unit in (("rss_mb", "MB"), ("workers_rss_mb", "MB"), ("fds", ""), ("threads", ""), ("tasks", ""),
                       ("sessions_open", "")):
        values = [getattr(s, name) for s in (result.idle_before, result.warm, result.loaded_end, result.idle_after)]
        rows.append([f"{name} {unit}".strip(), *[float(v) for v in values], result.drift_per_min[name]])
    lines = [table(["metric", "idle before", "after warm-up", "end of load", "idle after", "drift/min"], rows), ""]
    lines.append(f"connections {t.connections}, audio received {t.audio_bytes / 1e6:.0f} MB over "
                 f"{result.minutes:.1f} min")
    lines.append(table(["behaviour", "started", "completed"],
                       [[b, t.started[b], t.completed[b]] for b in BEHAVIOURS]))
    lines.append(f"expected errors/closes: {dict(sorted(t.expected.items()))}")
    lines.append(f"close codes seen by clients: {dict(sorted(t.close_codes.items()))}")
    lines.append(f"server errors sent, by code (/metrics): {dict(sorted(result.server_errors.items()))}")
    lines.append(f"UNEXPECTED (must be empty): {dict(t.unexpected)}")
    lines.append(f"server log, WARNING and above: {result.server_log}")
    lines.append(f"leak-free (idle after == idle before for fds and tasks, no unexpected errors): {result.leak_free}")
    return "\n".join(lines)


def parse_mix(text: str) -> list[float]:
    weights = dict.fromkeys(BEHAVIOURS, 0.0)
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in weights:
            raise argparse.ArgumentTypeError(f"unknown behaviour {name!r} (known: {', '.join(BEHAVIOURS)})")
        weights[name] = float(value)
    return [weights[b] for b in BEHAVIOURS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--engine", choices=("null", "hibari"), default="null")
    parser.add_argument("--engine-workers", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=200, help="client slots (sessions open at once, at most)")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=45.0, help="seconds before drift is measured")
    parser.add_argument("--ramp", type=float, default=10.0, help="slot start times spread over this")
    parser.add_argument("--think", type=lambda s: tuple(float(x) for x in s.split(",")), default=None,
                        help="MIN,MAX seconds between behaviours (default: 0.5,3 null; 8,20 hibari)")
    parser.add_argument("--mix", type=parse_mix, default=parse_mix(DEFAULT_MIX), dest="weights",
                        help=f"behaviour weights (default {DEFAULT_MIX})")
    parser.add_argument("--stall-hold", type=float, default=25.0,
                        help="seconds a stalling client stops reading (the server's stall timeout is 15 s)")
    parser.add_argument("--client-rcvbuf", type=int, default=65536,
                        help="SO_RCVBUF of every client socket (small: a stalled reader blocks the server soon)")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = parser.parse_args(argv)
    if args.think is None:
        args.think = DEFAULT_THINK[args.engine]
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    result = asyncio.run(soak(args))
    print(f"\nsoak, engine {args.engine}, {args.sessions} client slots, {args.duration:g} s, think "
          f"{args.think[0]:g}-{args.think[1]:g} s, drift after {args.warmup:g} s")
    print(report(result))
    if args.json:
        print(dump_json({"bench": "soak", "args": {k: v for k, v in vars(args).items()}, **result.as_dict()}))
    return 0 if result.leak_free else 1


if __name__ == "__main__":
    sys.exit(main())
