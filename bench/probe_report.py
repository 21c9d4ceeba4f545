"""Where a burst's first frames go in vllm-omni's talker: the step probe's lines read back as a timeline.

Input: the `VWPROBE` lines of a server whose processes ran with `bench/gpu/step_probe` (`bench/gpu/probe_burst.sh`
on the GPU machine; on the CPU: `VW_PROBE=1 VW_PROBE_FILE=probe.txt PYTHONPATH=bench/gpu/step_probe python -m
bench.omni_duel ...`). Each line: `VWPROBE pid what start_s ms details`.

A burst is a run of the server's engine calls less than `--gap-ms` apart (sessions sent together). For each
burst the report says when its requests reached the talker's engine core (ms after its first engine call) and
in how many steps their prompts were built, then the talker's steps from its first call on: when each starts,
its `execute_model` time, its `_preprocess` time and, inside that, the prefilling requests it built
(`prefill_preprocess`: how many, ms in all), the code predictor's batch and time, `sample_tokens` time. Then,
per burst size, the median [min-max] over bursts of the figures `report` names. Run: `python -m
bench.probe_report probe.txt [--steps 6]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

CALL_WINDOW_S = 5.0
"""How long after a burst's last engine call its requests' arrivals and prompts are looked for (a unit's id can
recur in a later burst)."""


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
    """Requests reaching the talker's engine core (every stage's core gets each request): `add_request` in the
    talker's `worker` where the core runs its model in-process (one GPU), else in the worker's parent process (the
    core of a multiprocess executor, as on the CPU)."""
    requests: dict[int, list[Event]] = defaultdict(list)
    for event in events:
        if event.what == "add_request":
            requests[event.pid].append(event)
    if worker in requests:
        return requests[worker]
    parents = {e.pid: int(e.details["ppid"]) for e in events if e.what == "process" and "ppid" in e.details}
    if worker not in parents:
        raise ValueError("no `process` line names the talker worker's parent: a probe older than this report?")
    return requests.get(parents[worker], [])


def bursts(calls: list[Event], gap_ms: float) -> list[list[Event]]:
    """Runs of events (the server's engine calls) less than `gap_ms` apart: the sessions it sent together."""
    groups: list[list[Event]] = []
    for event in calls:
        if groups and (event.start - groups[-1][-1].start) * 1000 < gap_ms:
            groups[-1].append(event)
        else:
            groups.append([event])
    return groups


@dataclass
class Burst:
    """One burst of engine calls and what the talker did with it; times in ms after its first engine call."""

    calls: list[Event]
    arrived: list[Event]
    prefill_steps: list[Step]
    steps: list[Step]

    @property
    def t0(self) -> float:
        return self.calls[0].start

    def ms(self, when: float) -> float:
        return (when - self.t0) * 1000

    def built(self) -> list[Event]:
        """The prompts built for this burst's requests."""
        units = _units(self.calls)
        return [p for step in self.prefill_steps for p in step.prefills if _unit(p) in units]

    def decode_steps(self) -> list[Step]:
        """The steps after the last one that built its prompts."""
        last = self.prefill_steps[-1].execute.start if self.prefill_steps else self.t0
        return [step for step in self.steps if step.execute.start > last]


def _unit(event: Event) -> str:
    """The engine call's id of a request id (the core's ids are the call's id and a random suffix)."""
    return event.details.get("id", "?").rsplit("-", 1)[0]


def _units(calls: list[Event]) -> set[str]:
    return {call.details.get("id", "?") for call in calls}


def match(burst_calls: list[Event], steps: list[Step], core_requests: list[Event]) -> Burst:
    """A burst's arrivals at the talker's core and the talker steps that built its prompts, both within
    `CALL_WINDOW_S` after its last call (a unit's id can recur later)."""
    t0, units = burst_calls[0].start, _units(burst_calls)
    until = burst_calls[-1].start + CALL_WINDOW_S
    arrived: dict[str, Event] = {}
    for event in core_requests:
        if t0 <= event.start <= until and _unit(event) in units:
            arrived.setdefault(_unit(event), event)
    later = [step for step in steps if step.execute.start >= t0]
    prefill = [step for step in later if step.execute.start <= until and any(_unit(p) in units for p in step.prefills)]
    return Burst(burst_calls, sorted(arrived.values(), key=lambda e: e.start), prefill, later)


def _ms(event: Event | None) -> str:
    return "-" if event is None else f"{event.ms:.1f}"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]" if values else "-"


SUMMARY = ("calls to the core's last arrival", "prefill steps", "last prompt built", "one prompt's build",
           "prefill execute", "first decode step at", "decode step execute")


def timeline(burst: Burst, steps_shown: int) -> list[str]:
    """One burst as text: its arrivals, the steps that prefilled it, then the talker's next steps."""
    arrived = burst.arrived
    span = f"{burst.ms(arrived[0].start):.1f} to {burst.ms(arrived[-1].start):.1f}" if arrived else "-"
    out = [f"burst of {len(burst.calls)} engine calls over {burst.ms(burst.calls[-1].start):.1f} ms; "
           f"{len(arrived)} reached the talker's core from {span} ms, prompts built {len(burst.built())} in "
           f"{len(burst.prefill_steps)} steps",
           "  step  at ms  execute  preprocess  prefills (ms)   mtp batch (ms)  sample"]
    for index, step in enumerate(burst.steps[:steps_shown]):
        prefills = f"{len(step.prefills)} ({sum(p.ms for p in step.prefills):.1f})" if step.prefills else "-"
        mtp = f"{step.mtp.details.get('batch', '?')} ({step.mtp.ms:.1f})" if step.mtp is not None else "-"
        out.append(f"  {index:>4}  {burst.ms(step.execute.start):6.1f}  {step.execute.ms:7.1f}  "
                   f"{_ms(step.preprocess):>10}  {prefills:>13}  {mtp:>14}  {_ms(step.sample):>6}")
    return out


def figures(burst: Burst, decode_steps: int = 5) -> dict[str, float]:
    """The summary's figures for one burst whose every request got its prompt built (ms after its first engine
    call, or ms each); empty otherwise."""
    built = burst.built()
    if len(built) < len(burst.calls) or not burst.prefill_steps:
        return {}
    decode = burst.decode_steps()[:decode_steps]
    result = {
        "prefill steps": float(len(burst.prefill_steps)),
        "last prompt built": burst.ms(max(p.end for p in built)),
        "one prompt's build": statistics.median(p.ms for p in built),
        "prefill execute": sum(step.execute.ms for step in burst.prefill_steps),
    }
    if len(burst.arrived) == len(burst.calls):  # else a request's line was lost (a probe printing to stderr)
        result["calls to the core's last arrival"] = burst.ms(burst.arrived[-1].start)
    if decode:
        result["first decode step at"] = burst.ms(decode[0].execute.start)
        result["decode step execute"] = statistics.median(step.execute.ms for step in decode)
    return result


def report(events: list[Event], steps_shown: int, gap_ms: float) -> str:
    """The per-burst timelines, then per burst size the median [min-max] over bursts of each figure in `SUMMARY`
    (ms after the burst's first engine call; a prompt's build and a step's execute in ms each; the prefill steps'
    execute summed; decode steps: the first five after the burst's last prefill step)."""
    worker = talker_worker(events)
    steps = talker_steps(events, worker)
    core_requests = arrivals(events, worker)
    calls = [e for e in events if e.what == "engine_call"]
    out: list[str] = []
    by_size: dict[int, list[dict[str, float]]] = defaultdict(list)
    for group in bursts(calls, gap_ms):
        burst = match(group, steps, core_requests)
        out.extend(timeline(burst, steps_shown))
        found = figures(burst)
        if found:
            by_size[len(group)].append(found)
    out.append("")
    out.append("per burst size, median [min-max] over bursts (ms after the burst's first engine call, or ms each)")
    out.append(f"{'size':>4}  {'bursts':>6}  " + "  ".join(f"{name:>26}" for name in SUMMARY))
    for size in sorted(by_size):
        rows = by_size[size]
        cells = [_spread([row[name] for row in rows if name in row]) for name in SUMMARY]
        out.append(f"{size:>4}  {len(rows):>6}  " + "  ".join(f"{cell:>26}" for cell in cells))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", type=Path, help="a file of VWPROBE lines (a server log will do)")
    parser.add_argument("--steps", type=int, default=6, help="talker steps shown after each burst's first arrival")
    parser.add_argument("--gap-ms", type=float, default=50.0, help="engine calls closer than this are one burst")
    args = parser.parse_args(argv)
    events = parse(args.probe.read_text(errors="replace").splitlines())
    if not events:
        print(f"no VWPROBE lines in {args.probe}", file=sys.stderr)
        return 1
    print(report(events, args.steps, args.gap_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
