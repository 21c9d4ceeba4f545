"""Time to first audio over the WebSocket against the engine's own first-audio time for the same unit.

One real server (`tests.server.ServerThread`: aiohttp on loopback, the real engine, uvloop) and one
`websockets` client session per split mode. Each repetition first primes the engine with the unit's text
(untimed, so neither timed run is the first for that text), then speaks one utterance and, interleaved
with it in alternating order, asks the *same started engine* for the same first unit directly on the
server's event loop (`engine.synthesize()` to its first piece). Both are timed on an idle server, so the
difference is what the serving path adds.

- WebSocket TTFA: from sending the message whose text completes the first unit to the first binary
  frame at the client. `none` mode: the whole sentence is sent, then (after a settle pause) the timed
  `input.done`. `sentence` mode: the text goes as ~4-character deltas; every delta before the one that
  commits the first unit (found by running the server's own segmenter on the same deltas) is sent first,
  then the timed committing delta.
- Server TTFA: the server's own `session.done.timings.first_audio_ms` (commit to handing the first audio
  to the socket), which splits our overhead into server side and loopback/client side.
- Engine TTFA: `synthesize()` call to its first `AudioPiece`, on the server's loop.

`--rounds` (default 5) repeats the whole measurement, every mode in each round on a fresh session of the
same server; the summary is median [min-max] over rounds of each round's figure, under a line naming the
date, the machine and the commit.

Run from the repository root: `python -m bench.ttfa` (see `--help`; docs/benchmarks.md has results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import websockets
from voicewire.adapters.base import Engine
from voicewire.protocol.engine import SynthesisRequest
from voicewire.protocol.segmenter import SplitGranularity
from voicewire.realtime.settings import Settings
from websockets.asyncio.client import ClientConnection

from bench.workload import SENTENCES, Provenance, dump_json, first_unit, percentile, spreads, table, tokens
from tests.server import ServerThread

T = TypeVar("T")
MODES: tuple[SplitGranularity, ...] = ("none", "sentence")
FIGURES = {key: "{:.1f}" for key in (
    "engine_p50_ms", "engine_p95_ms", "ws_p50_ms", "ws_p95_ms", "server_p50_ms", "server_p95_ms", "overhead_p50_ms",
    "overhead_p95_ms", "path_overhead_p50_ms", "path_overhead_p95_ms")} | {"ratio_p50": "{:.2f}"}
"""The figures of `ModeResult.summary` the report gives as median [min-max] over rounds, and their format."""


@dataclass
class ModeResult:
    mode: str
    ws_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    engine_ms: list[float] = field(default_factory=list)
    ws_compute_ms: list[float] = field(default_factory=list)
    engine_compute_ms: list[float] = field(default_factory=list)
    """Engine model + DSP time inside each measurement (hibari's counters; empty for other engines)."""

    def summary(self) -> dict[str, float | int | str]:
        overhead = [w - e for w, e in zip(self.ws_ms, self.engine_ms, strict=True)]
        server_over = [s - e for s, e in zip(self.server_ms, self.engine_ms, strict=True)]
        engine_p50 = percentile(self.engine_ms, 50)
        path = [(w - wc) - (e - ec) for w, wc, e, ec in
                zip(self.ws_ms, self.ws_compute_ms, self.engine_ms, self.engine_compute_ms, strict=False)]
        return {
            "mode": self.mode, "n": len(self.ws_ms),
            "engine_p50_ms": engine_p50, "engine_p95_ms": percentile(self.engine_ms, 95),
            "ws_p50_ms": percentile(self.ws_ms, 50), "ws_p95_ms": percentile(self.ws_ms, 95),
            "server_p50_ms": percentile(self.server_ms, 50), "server_p95_ms": percentile(self.server_ms, 95),
            "overhead_p50_ms": percentile(overhead, 50), "overhead_p95_ms": percentile(overhead, 95),
            "server_overhead_p50_ms": percentile(server_over, 50),
            "path_overhead_p50_ms": percentile(path, 50), "path_overhead_p95_ms": percentile(path, 95),
            "ratio_p50": percentile(self.ws_ms, 50) / engine_p50 if engine_p50 else float("nan"),
        }


@dataclass(frozen=True)
class Measured:
    ws_ms: float
    server_ms: float
    unit_text: str
    compute_ms: float | None


class Bench:
    def __init__(self, server: ServerThread, settle_s: float) -> None:
        self.server = server
        self.settle_s = settle_s
        self._requests = 0

    async def on_server(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the server's event loop (where the session runtime calls the engine)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.server.loop))

    def compute_s(self) -> float | None:
        """The engine's model + DSP seconds so far (in-process hibari's counters), None without them."""
        stats = getattr(self.server.ctx.engine, "stats", None)
        model = getattr(stats, "model_seconds", None)
        dsp = getattr(stats, "dsp_seconds", None)
        if model is None or dsp is None:
            return None  # e.g. the process engine, whose workers keep their counters
        return float(model + dsp)

    async def engine_first_ms(self, text: str) -> tuple[float, float | None]:
        """The engine's own TTFA for `text` on the server's loop; (ms, compute ms inside it)."""
        before = self.compute_s()
        engine: Engine = self.server.ctx.engine
        self._requests += 1
        request = SynthesisRequest(request_id=f"bench-direct-{self._requests}", text=text,
                                   voice=engine.info.default_voice)

        async def first_piece() -> float:
            started = time.perf_counter()
            pieces = engine.synthesize(request)
            try:
                await anext(pieces)
                return (time.perf_counter() - started) * 1000.0
            finally:
                await pieces.aclose()

        ms = await self.on_server(first_piece())
        after = self.compute_s()
        return ms, None if before is None or after is None else (after - before) * 1000.0

    async def utterance(self, ws: ClientConnection, mode: SplitGranularity, text: str) -> Measured:
        """Speak one utterance and time its first audio."""
        if mode == "none":
            before, timed, after = [_text(text)], _done(), []
        else:
            deltas = tokens(text)
            found = first_unit(deltas, mode)
            if found is None:
                raise ValueError(f"no unit is committed before input.done in {text!r}")
            k = found[0]
            before = [_text(d) for d in deltas[:k]]
            timed = _text(deltas[k])
            after = [*(_text(d) for d in deltas[k + 1:]), _done()]
        for message in before:
            await ws.send(message)
        await asyncio.sleep(self.settle_s)
        compute_before = self.compute_s()
        started = time.perf_counter()
        await ws.send(timed)
        first_text = ""
        ttfa_ms = -1.0
        compute_after: float | None = None
        while True:
            frame = await ws.recv()
            if isinstance(frame, bytes):
                ttfa_ms = (time.perf_counter() - started) * 1000.0
                compute_after = self.compute_s()
                break
            event = json.loads(frame)
            if event["type"] == "audio.start":
                first_text = event["sentence_text"]
            elif event["type"] == "error":
                raise RuntimeError(f"server error: {event}")
        for message in after:
            await ws.send(message)
        while True:
            frame = await ws.recv()
            if isinstance(frame, str):
                event = json.loads(frame)
                if event["type"] == "session.done":
                    compute = (None if compute_before is None or compute_after is None
                               else (compute_after - compute_before) * 1000.0)
                    return Measured(ttfa_ms, float(event["timings"]["first_audio_ms"]), first_text, compute)
                if event["type"] == "error":
                    raise RuntimeError(f"server error: {event}")


async def run(args: argparse.Namespace, server: ServerThread) -> list[list[ModeResult]]:
    """`--rounds` rounds, each every mode in turn, so a slow spell of the machine hits every mode; each
    round's sentences from its own seed (`--seed` + round)."""
    bench = Bench(server, args.settle_ms / 1000.0)
    rounds = []
    for round_ in range(args.rounds):
        rng = random.Random(args.seed + round_)
        rounds.append([await run_mode(bench, mode, args, rng) for mode in args.modes])
    return rounds


async def run_mode(bench: Bench, mode: SplitGranularity, args: argparse.Namespace, rng: random.Random) -> ModeResult:
    """One session in `mode`: `--warmup` utterances, then `--reps` measured ones."""
    result = ModeResult(mode)
    compression = None if args.compression == "none" else "deflate"
    async with websockets.connect(bench.server.ws_url, max_size=None, compression=compression) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True,
                                  "split_granularity": mode}))
        updated = json.loads(await ws.recv())
        assert updated["type"] == "session.updated", updated
        for rep in range(args.warmup + args.reps):
            first, second = rng.sample(SENTENCES, 2)
            text = first if mode == "none" else f"{first} {second}"
            # prime: both timed runs below then see this text second or later (warm caches either way)
            unit = _first_unit_text(mode, text)
            await bench.engine_first_ms(unit)
            if rep % 2 == 0:
                measured = await bench.utterance(ws, mode, text)
                engine_ms, engine_compute = await bench.engine_first_ms(measured.unit_text)
            else:
                engine_ms, engine_compute = await bench.engine_first_ms(unit)
                measured = await bench.utterance(ws, mode, text)
                assert measured.unit_text == unit, (measured, text)
            if rep >= args.warmup:
                result.ws_ms.append(measured.ws_ms)
                result.server_ms.append(measured.server_ms)
                result.engine_ms.append(engine_ms)
                if measured.compute_ms is not None and engine_compute is not None:
                    result.ws_compute_ms.append(measured.compute_ms)
                    result.engine_compute_ms.append(engine_compute)
    return result


def summary_rows(rounds: Sequence[Sequence[Mapping[str, Any]]], modes: Sequence[str]) -> list[list[object]]:
    """Per mode: its rounds, then median [min-max] over them of each of `FIGURES` (`rounds`: each round's
    `ModeResult.summary()` per mode)."""
    rows: list[list[object]] = []
    for mode in modes:
        mine = [s for round_ in rounds for s in round_ if s["mode"] == mode]
        rows.append([mode, len(mine), *spreads(mine, FIGURES)])
    return rows


def _first_unit_text(mode: SplitGranularity, text: str) -> str:
    """The first unit the server will make of `text` (`none` mode: the whole text)."""
    if mode == "none":
        return text.strip()
    found = first_unit(tokens(text), mode)
    assert found is not None
    return found[1]


def _text(text: str) -> str:
    return json.dumps({"type": "input.text", "text": text})


def _done() -> str:
    return json.dumps({"type": "input.done"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="measured runs of every mode, reported as median "
                        "[min-max]")
    parser.add_argument("--reps", type=int, default=60, help="measured utterances per mode and round")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured utterances per mode first")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                        help="comma-separated split modes: none,sentence")
    parser.add_argument("--engine", default="hibari")
    parser.add_argument("--engine-workers", type=int, default=1)
    parser.add_argument("--engine-isolation", choices=("process", "thread"), default="process",
                        help="hibari in worker processes (the server's default) or threads")
    parser.add_argument("--settle-ms", type=float, default=30.0,
                        help="pause before the timed message so earlier deltas are processed")
    parser.add_argument("--compression", choices=("deflate", "none"), default="deflate",
                        help="permessage-deflate offered by the client (browsers and websockets offer it)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's default loop on both sides")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = parser.parse_args(argv)
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}")
    if not args.no_uvloop:
        try:
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        except ImportError:
            pass
    provenance = Provenance.begin()
    server = ServerThread(Settings(engine=args.engine, engine_workers=args.engine_workers,
                                   engine_isolation=args.engine_isolation))
    try:
        rounds = asyncio.run(run(args, server))
    finally:
        server.stop()
    provenance = provenance.end()
    summaries = [[r.summary() for r in round_] for round_ in rounds]
    if args.json:
        print(dump_json({"bench": "ttfa", "provenance": provenance.as_dict(), "args": vars(args),
                         "rounds": [{"results": s, "raw": [vars(r) for r in round_]}
                                    for s, round_ in zip(summaries, rounds, strict=True)]}))
        return 0
    print(provenance.line())
    print(f"TTFA, {args.rounds} rounds of {args.reps} utterances per mode, engine {args.engine} "
          f"(workers={args.engine_workers}, {args.engine_isolation}), client compression {args.compression}, "
          f"uvloop {not args.no_uvloop}")
    names = ["engine p50", "engine p95", "ws p50", "ws p95", "server p50", "server p95", "overhead p50",
             "overhead p95", "path p50", "path p95", "ratio p50"]
    print(table(["round", "mode", "n", *names],
                [[number + 1, s["mode"], s["n"], *(s[key] for key in FIGURES)]
                 for number, round_ in enumerate(summaries) for s in round_]))
    print()
    print(f"median [min-max] over {args.rounds} rounds of each round's figure:")
    print(table(["mode", "rounds", *names], summary_rows(summaries, args.modes)))
    print("(ms. engine: synthesize() to first piece on the server's loop; ws: timed message sent to first binary "
          "frame at the client;\n server: the server's own timings.first_audio_ms; overhead: ws - engine, paired per "
          "utterance;\n path: the same with each side's engine compute (model + DSP) taken out, which removes "
          "compute jitter;\n ratio: ws p50 / engine p50. Target: overhead p50 < 5 ms.)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
