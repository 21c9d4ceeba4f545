"""What the benches feed the server and how they summarise it: varied sentences, LLM-like token streams,
where the first synthesis unit is committed, percentiles, median [min-max] over rounds, plain-text tables
and the header line that says when, where and on which commit a bench ran (`Provenance`); and the server
itself, run as its own process (`ServerProcess`).

The first-unit position comes from running the same pure `Segmenter` the server runs, with the server's
settings, so a bench knows exactly which delta completes the first unit without guessing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from voicewire.protocol.segmenter import Segmenter, SplitGranularity

from tests.server import Loopback, free_port

SENTENCES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Can you tell me what the weather will be like in Paris tomorrow?",
    "Your appointment with Dr. Patel is on Tuesday at ten thirty.",
    "I found three restaurants near you that are open until midnight.",
    "The package was shipped yesterday and should arrive within two days.",
    "Sure, I can help you reset your password right now.",
    "The total comes to 42 dollars and 17 cents, including tax.",
    "Would you like me to read the next message aloud?",
    "Traffic on the highway is heavier than usual this evening.",
    "Remember to bring an umbrella, because it might rain later.",
    "The museum opens at nine and closes at five on weekdays.",
    "I have added milk, eggs and fresh bread to your shopping list.",
    "Your flight to Tokyo departs from gate B twelve at noon.",
    "That song was released in 1999 and became a worldwide hit.",
    "Please hold on while I look up the latest account balance.",
    "The meeting has been moved to Thursday afternoon at three.",
    "Green tea contains less caffeine than a regular cup of coffee.",
    "Is there anything else I can do for you today?",
    "The library will be closed for renovations until next month.",
    "Turn left at the second traffic light and the store is on your right.",
    "Honestly, that was one of the best movies I have seen this year.",
    "The battery is at fifteen percent, so you may want to charge it soon.",
    "Our support team usually replies within one business day.",
    "The recipe calls for two cups of flour and a pinch of salt.",
)
"""Assistant-style sentences of 5 to 15 words (about 2 to 5 s of speech each), with questions,
numbers, an abbreviation and a few commas (which the fast first unit may split at)."""


def tokens(text: str, size: int = 4) -> list[str]:
    """Cut `text` into LLM-like deltas of about `size` characters (whole text, nothing dropped)."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def first_unit(deltas: Sequence[str], granularity: SplitGranularity,
               max_unit_chars: int = 250) -> tuple[int, str] | None:
    """Where the server commits an utterance's first speakable unit: (index of the delta whose arrival
    commits it, the unit's text as the server speaks it), or None when only `input.done` commits it. Runs
    the server's own segmenter on the same deltas."""
    segmenter = Segmenter(granularity, max_unit_chars=max_unit_chars)
    for index, delta in enumerate(deltas):
        for segment in segmenter.push(delta, 0.0):
            if any(ch.isalnum() for ch in segment.text):
                return index, segment.text.strip()
    return None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: Sequence[float], fmt: str = "{:.0f}") -> str:
    """`median [min-max]` of one figure over rounds; rounds without it (nan) are left out, and with none
    left it is `-`."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return "-"
    return f"{fmt.format(statistics.median(known))} [{fmt.format(min(known))}-{fmt.format(max(known))}]"


def spreads(rounds: Sequence[Mapping[str, float]], figures: Mapping[str, str]) -> list[str]:
    """`spread` over `rounds` (each round's figures by key) of each figure in `figures` (key -> format)."""
    return [spread([float(r[key]) for r in rounds], fmt) for key, fmt in figures.items()]


def held_every_round(passes: Mapping[int, Sequence[bool]], rounds: int) -> int:
    """The largest level (N sessions, N streams) that passed in each of `rounds` rounds, as did every
    smaller level tried; 0 for none. `passes` maps each level tried to its rounds' outcomes; a level run in
    fewer rounds (a round stopped before it) does not hold."""
    best = 0
    for level in sorted(passes):
        outcomes = passes[level]
        if len(outcomes) < rounds or not all(outcomes):
            break
        best = level
    return best


@dataclass(frozen=True, slots=True)
class Provenance:
    """When, where and on which code a bench ran: the header line above its results and the `provenance`
    of its JSON. `begin()` when the bench starts, `end()` when it reports (the load average is read at
    both: a busy machine moves the figures)."""

    started: str
    """UTC, ISO 8601 to the second."""
    host: str
    cpu: str
    """The CPU model as /proc/cpuinfo names it."""
    cores: int
    load_before: tuple[float, float, float]
    commit: str
    """`git_commit`: $VOICEWIRE_COMMIT where set (what a device call runs), else `git rev-parse --short
    HEAD`, `+dirty` when tracked files have changes, else `unknown`."""
    ended: str = ""
    load_after: tuple[float, float, float] | None = None
    gpu: str = ""
    """The GPUs (`gpu_names` of `nvidia-smi`'s list), "" where there is none: a device call asking for one
    kind of GPU may run on another (an H100 for an H200), and the results must say which."""

    @classmethod
    def begin(cls) -> Provenance:
        try:
            with open("/proc/cpuinfo") as f:
                cpu = cpu_model(f.read())
        except OSError:
            cpu = "unknown CPU"
        return cls(_utc_now(), socket.gethostname(), cpu, os.cpu_count() or 0, os.getloadavg(), git_commit(),
                   gpu=gpu_names(_nvidia_smi_names()))

    def end(self) -> Provenance:
        return dataclasses.replace(self, ended=_utc_now(), load_after=os.getloadavg())

    def line(self) -> str:
        """`2026-12-05 10:31:07-10:45:12 UTC, host (CPU, 2 cores), load 0.41 0.35 0.30 -> 1.20 0.80 0.50,
        commit 6e464c8+dirty`."""
        when = f"{self.started[:10]} {self.started[11:19]}"
        if self.ended:
            when += "-" + (self.ended[11:19] if self.ended[:10] == self.started[:10]
                           else f"{self.ended[:10]} {self.ended[11:19]}")
        load = " ".join(f"{v:.2f}" for v in self.load_before)
        if self.load_after is not None:
            load += " -> " + " ".join(f"{v:.2f}" for v in self.load_after)
        gpu = f"; {self.gpu}" if self.gpu else ""
        return f"{when} UTC, {self.host} ({self.cpu}, {self.cores} cores{gpu}), load {load}, commit {self.commit}"

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def gpu_names(listing: str) -> str:
    """The GPUs in `nvidia-smi --query-gpu=name --format=csv,noheader` output (one name a line), as
    "NVIDIA H200" or, for several alike, "2 x NVIDIA H100 80GB HBM3" (kinds joined by " + "); "" for none."""
    counts = collections.Counter(line.strip() for line in listing.splitlines() if line.strip())
    return " + ".join(name if n == 1 else f"{n} x {name}" for name, n in counts.items())


def _nvidia_smi_names() -> str:
    """`nvidia-smi`'s list of GPU names, "" where it is missing or fails."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def cpu_model(cpuinfo: str) -> str:
    """The CPU model in /proc/cpuinfo's text (x86 `model name`, else ARM's `Hardware` or `CPU part`)."""
    named: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        named.setdefault(key.strip(), value.strip())
    return next((named[key] for key in ("model name", "Hardware", "CPU part") if named.get(key)), "unknown CPU")


REPOSITORY = Path(__file__).resolve().parent.parent


def git_commit(repo: Path = REPOSITORY) -> str:
    """$VOICEWIRE_COMMIT where it is set (a device machine's copy of the tree may carry stale git metadata:
    on 2026-12-06 it named a commit six back); else `repo`'s HEAD as `git rev-parse --short` writes it,
    `+dirty` when tracked files have changes; `unknown` where there is no git checkout."""
    given = os.environ.get("VOICEWIRE_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changes = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if changes else "")


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Stream:
    """One client's view of one streamed utterance (`play`)."""

    ttfa_ms: float
    audio_s: float
    rtf: float
    stall_s: float
    stalls: int
    stall_chunks: tuple[int, ...] = ()


def play(sent_at: float, arrivals: Sequence[tuple[float, int]], rate: int) -> Stream:
    """Replay arrivals (time, samples at `rate` Hz), at least one, through a player that starts at the first
    byte: whenever a chunk arrives after the audio before it has finished playing, the gap is a stall, and
    playback resumes from there. TTFA is from `sent_at` to the first arrival; the real-time factor is (last
    arrival - `sent_at`) / audio seconds."""
    start = arrivals[0][0]
    played_until = start
    stall_s, stalls, where = 0.0, 0, []
    for index, (at, samples) in enumerate(arrivals):
        if at > played_until:
            stall_s += at - played_until
            stalls += 1
            where.append(index)
            played_until = at
        played_until += samples / rate
    audio_s = sum(n for _, n in arrivals) / rate
    return Stream((start - sent_at) * 1000.0, audio_s, (arrivals[-1][0] - sent_at) / audio_s, stall_s, stalls,
                  tuple(where))


def utterance(rng: random.Random, sentences: int) -> str:
    """`sentences` distinct random sentences joined into one reply."""
    return " ".join(rng.sample(SENTENCES, sentences))


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A left-aligned plain-text table; floats with two decimals."""
    cells = [[_cell(v) for v in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def dump_json(data: object) -> str:
    return json.dumps(data, indent=2, default=float)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.2f}"
    return str(value)


class ServerProcess(Loopback):
    """`python -m voicewire.realtime --no-auth` on a free loopback port, its log in a temporary file; admission
    by capacity is off (benchmarks load the engine past it on purpose).

    `extra` adds flags; `cpus` pins the server (and the engine processes it spawns) to those cores.
    """

    def __init__(self, engine: str = "hibari", max_sessions: int = 10000, extra: Sequence[str] = (),
                 cpus: set[int] | None = None) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="voicewire-bench-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "voicewire.realtime", "--port", str(self.port), "--engine", engine,
                   "--max-sessions", str(max_sessions), "--admission-utilization", "0", "--no-auth", "--log-level",
                   "WARNING", *extra]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        self.pid = self.proc.pid

    async def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log.name}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{self.http_url}/ready") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.2)
        raise TimeoutError("server not ready")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (the engine's worker processes)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def schedstat(pid: int) -> tuple[float, float, float]:
    """(main thread CPU, other threads' CPU, run-queue wait of all threads) seconds of process `pid` so far
    (/proc schedstat; a thread that exits while being read is left out)."""
    main = other = wait = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            run_ns, wait_ns, _ = f.read().split()
            if int(tid) == pid:
                main += int(run_ns) / 1e9
            else:
                other += int(run_ns) / 1e9
            wait += int(wait_ns) / 1e9
    return main, other, wait
