"""Where a burst's first frames go in vllm-omni's talker: the step probe's lines read back as a timeline.

Input: the `VWPROBE` lines of a server whose processes ran with `bench/gpu/step_probe` (`bench/gpu/probe_burst.sh`
on the GPU machine; on the CPU: `VW_PROBE=1 PYTHONPATH=bench/gpu/step_probe python -m bench.omni_duel ...`, then
`grep VWPROBE <out>/voicewire.log`). Each line: `VWPROBE pid what start_s ms details`.

A burst is a run of requests reaching the talker's engine core less than `--gap-ms` apart. For each burst the
report gives the spread of the arrivals, when the server's engine calls for them came (ms from the first
arrival, negative before it), and the talker's first steps after the first arrival: when each step
starts (ms after the first arrival), its `execute_model` time, its `_preprocess` time and, inside that, the
prefilling requests it built (`prefill_preprocess`: how many, ms in all), the code predictor's batch and time,
`sample_tokens` time. Then, per burst size, the median over bursts of: the time until the last of the burst's
prompts is built, and a prompt's build time. Run: `python -m bench.probe_report probe.txt [--steps 6]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

CALL_WINDOW_S = 5.0
"""How long before a burst's first arrival an engine call may be one of its requests' (a unit's id can recur)."""


@dataclass(frozen=True)
class Event:
    """One probe line: a call in process `pid`, started at `start` (CLOCK_MONOTONIC s), lasting `ms`."""

    pid: int
    what: str
    start: float
    ms: float
    details: dict[str, str]

    @property
    def end(self) -> float:
        return self.start + self.ms / 1000.0


@dataclass
class Step:
    """One talker step in the worker: its `execute_model` call and the calls inside or right after it."""

    execute: Event
    preprocess: Event | None = None
    prefills: list[Event] = field(default_factory=list)
    mtp: Event | None = None
    sample: Event | None = None


def parse(lines: list[str]) -> list[Event]:
    """The probe's lines (anything else is skipped), in order of start."""
    events = []
    for line in lines:
        parts = line.split()
        if len(parts) < 5 or parts[0] != "VWPROBE":
            continue
        try:
            pid, start, ms = int(parts[1]), float(parts[3]), float(parts[4])
        except ValueError:
            continue
        details = dict(part.split("=", 1) for part in parts[5:] if "=" in part)
        events.append(Event(pid, parts[2], start, ms, details))
    return sorted(events, key=lambda e: e.start)


def talker_steps(events: list[Event], worker: int | None) -> list[Step]:
    """The steps of `worker` (the talker's), each with what ran in it: a call belongs to the last
    `execute_model` started before it."""
    steps: list[Step] = []
    for event in (e for e in events if e.pid == worker):
        if event.what == "execute_model":
            steps.append(Step(event))
        elif not steps:
            continue
        elif event.what == "preprocess":
            steps[-1].preprocess = event
        elif event.what == "prefill_preprocess":
            steps[-1].prefills.append(event)
        elif event.what == "talker_mtp":
            steps[-1].mtp = event
        elif event.what == "sample_tokens":
            steps[-1].sample = event
    return steps


def talker_worker(events: list[Event]) -> int | None:
    """The process that built the most prefilling prompts: the talker's worker."""
    counts: dict[int, int] = defaultdict(int)
    for event in events:
        if event.what == "prefill_preprocess":
            counts[event.pid] += 1
    return max(counts, key=lambda pid: counts[pid]) if counts else None


def arrivals(events: list[Event], worker: int | None) -> list[Event]:
    """Requests reaching the talker's engine core (the parent process of the talker's `worker`; every stage's
    core gets each request): `add_request` there."""
    parents = {e.pid: e.details.get("ppid") for e in events if e.what == "process"}
    core = parents.get(worker) if worker is not None else None
    if core is None:
        raise ValueError("no `process` line names the talker worker's parent: a probe older than this report?")
    return [e for e in events if e.what == "add_request" and str(e.pid) == core]


def bursts(requests: list[Event], gap_ms: float) -> list[list[Event]]:
    """Runs of arrivals less than `gap_ms` apart."""
    groups: list[list[Event]] = []
    for event in requests:
        if groups and (event.start - groups[-1][-1].start) * 1000 < gap_ms:
            groups[-1].append(event)
        else:
            groups.append([event])
    return groups


def _ms(event: Event | None) -> str:
    return "-" if event is None else f"{event.ms:.1f}"


def report(events: list[Event], steps_shown: int, gap_ms: float) -> str:
    """The per-burst timelines and the per-size medians, as text."""
    worker = talker_worker(events)
    steps = talker_steps(events, worker)
    out: list[str] = []
    by_size: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for burst in bursts(arrivals(events, worker), gap_ms):
        t0 = burst[0].start
        ids = {e.details.get("id") for e in burst}
        spread = (burst[-1].start - t0) * 1000
        later = [s for s in steps if s.execute.start >= t0][:steps_shown]
        built = [p for s in steps if s.execute.start >= t0 for p in s.prefills if p.details.get("id") in ids]
        calls = [e for e in events if e.what == "engine_call" and t0 - CALL_WINDOW_S <= e.start <= burst[-1].start
                 and any(arrival.details.get("id", "").startswith(e.details.get("id", "?")) for arrival in burst)]
        called = (f"; engine calls from {(calls[0].start - t0) * 1000:.1f} to {(calls[-1].start - t0) * 1000:.1f} ms"
                  if calls else "")
        out.append(f"burst of {len(burst)} (arrivals over {spread:.1f} ms{called}), prompts built {len(built)}")
        out.append("  step  at ms  execute  preprocess  prefills (ms)   mtp batch (ms)  sample")
        for index, step in enumerate(later):
            prefills = f"{len(step.prefills)} ({sum(p.ms for p in step.prefills):.1f})" if step.prefills else "-"
            mtp = f"{step.mtp.details.get('batch', '?')} ({step.mtp.ms:.1f})" if step.mtp is not None else "-"
            out.append(f"  {index:>4}  {(step.execute.start - t0) * 1000:6.1f}  {step.execute.ms:7.1f}  "
                       f"{_ms(step.preprocess):>10}  {prefills:>13}  {mtp:>14}  {_ms(step.sample):>6}")
        if built and len(built) >= len(burst):
            done = (max(p.end for p in built) - t0) * 1000
            by_size[len(burst)].append((done, statistics.median(p.ms for p in built)))
    out.append("")
    out.append("burst size  bursts  last prompt built, ms after the first arrival  one prompt's build, ms (medians)")
    for size in sorted(by_size):
        rows = by_size[size]
        done = statistics.median(r[0] for r in rows)
        each = statistics.median(r[1] for r in rows)
        out.append(f"{size:>10}  {len(rows):>6}  {done:>45.1f}  {each:>30.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", type=Path, help="a file of VWPROBE lines (a server log will do)")
    parser.add_argument("--steps", type=int, default=6, help="talker steps shown after each burst's first arrival")
    parser.add_argument("--gap-ms", type=float, default=50.0, help="arrivals closer than this are one burst")
    args = parser.parse_args(argv)
    events = parse(args.probe.read_text(errors="replace").splitlines())
    if not events:
        print(f"no VWPROBE lines in {args.probe}", file=sys.stderr)
        return 1
    print(report(events, args.steps, args.gap_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
