"""The talker engine through the whole serving path, on the GPU machine (H200), with the raw talker beside it.

One process runs the real server (`tests.server.ServerThread`: aiohttp, the session runtime, the scheduler)
with the talker engine in random-weight mode: an Orpheus-3B-shaped talker (Llama-3.2-3B layout, vLLM
`load_format="dummy"`) and a random-init SNAC 24 kHz decoder at the real sizes. A second process runs the
WebSocket clients (`websockets`), so client work never shares the server's interpreter.

For each concurrency C: C sessions at once each speak one utterance (`split_granularity="none"`, pcm16 at
24 kHz streamed in binary frames) after one warm-up round of the same shape. Per stream:
- TTFA: from sending `input.done` (the message that completes the unit) to the first binary frame;
- stalls as a player sees them: playback starts at the first audio byte; whenever a chunk arrives after
  the audio before it has finished playing, the gap is a stall (and playback resumes from there);
- real-time factor: (last audio byte - input.done) / audio seconds;
and for the level: audio seconds delivered per wall second over all streams.

Where the time goes (`--trace`, on by default): the engine records each unit's first-chunk stages (call,
first vLLM output, first frame, codec batch start / end, piece yielded; `TalkerEngine.trace`), paired with the
client's send and first-byte times through the session's seed, so TTFA splits into: client -> engine call,
talker prefill + first 7 tokens, codec queue wait, codec decode, hand-back, server -> client. Stalls are
reported with the index of the chunk that arrived late, and the chunks after the first that the server's
codec decoded past their deadline with where their time went (`talker.late_windows`: the time from the cut
to the deadline, the codec queue wait, the batch's decode, the backlog estimated at the cut; one line per
round, each chunk in `talker_gpu.json` under `late_windows`). Beside the stages, per round: the ms from handing
the engine the level's C requests at once until the last is in vLLM (`TalkerEngine.frontend_seconds`: prompt,
tokenized in batches off the loop, sampling parameters, vLLM's `add_request`; aborted at once), the part of a
burst that is the engine's own frontend rather than the serving path. `--frontend-only` measures that alone, without
sessions, at levels a CPU cannot serve (`--shape tiny --frontend-only --concurrency 64,128 --rounds 10`), with
the CPU the loop's thread spent meanwhile (what the burst's other sessions wait behind).

Before the server starts, a codec micro-benchmark (CUDA only): the SNAC decoder alone, float32 eager (the
previous engine) against the engine's float16 CUDA graphs, per (batch, window frames), and the float16
error against float32 on a noise-free decoder of the same sizes.

Levels are `C` or `C:I` (`I` = `initial_codec_chunk_frames` sent by every session; default: the engine's).

Beside it, the raw talker: the same units' token streams straight from the engine's `AsyncLLM`
(`TalkerEngine.talker_tokens`, no codec, no server), C at once: time to the first frame's 7 tokens and the
per-stream frame rate as a real-time factor. The ratio of the two TTFAs is what the serving path adds.

Run from the repository root: `python -m bench.talker_gpu --out DIR` (see `--help`; `--shape tiny` runs the
same path on the CPU in a few minutes). `--budget-s` starts no level or round past that many seconds, and
a SIGTERM (`timeout`) still prints what ran. On the GPU machine: `bash bench/gpu/talker.sh` (payload,
carry list and sizes in bench/gpu/README.md). Results: docs/benchmarks.md, "Talker on GPU".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import multiprocessing
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from voicewire.adapters.talker import TalkerConfig, TalkerEngine, late_windows
from voicewire.adapters.talker_layout import CODES_PER_FRAME, SAMPLE_RATE, SAMPLES_PER_FRAME
from voicewire.adapters.talker_testing import LLAMA_3_2_3B, SNAC_24KHZ, TINY_LLAMA, TINY_SNAC, write_snac, write_talker
from voicewire.protocol.engine import SynthesisRequest
from voicewire.realtime.settings import Settings

from bench.workload import Provenance, percentile, play, spread, table
from tests.server import ServerThread

TEXT = ("Your flight to Tokyo departs from gate B twelve at noon, and boarding begins forty minutes earlier, "
        "so please have your passport and boarding pass ready.")
"""153 characters: 115 frames, 9.8 s of audio in random-weight mode."""
WARM_TEXT = "Warm up this concurrency level, please."
FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE


class GcPauses:
    """Every garbage-collector pause in this process while installed (the bench installs one in the server's
    process and one in the clients'): `ms`, and in `full` each pause of the oldest generation as (ms,
    objects collected, the thread that ran it, its start on `time.perf_counter`'s clock, which both
    processes share)."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self.full: list[tuple[float, int, str, float]] = []
        self._began = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        ms = 1000 * (time.perf_counter() - self._began)
        self.ms.append(ms)
        if info["generation"] == 2:
            self.full.append((ms, info["collected"], threading.current_thread().name, self._began))


def late_summary(late: list[dict[str, float]]) -> str:
    """One line on the chunks after the first that the server's codec decoded past their deadline
    (`talker.late_windows` of every stream): where in the unit, the time each had from its cut, and where it
    went."""
    at = Counter(int(w["chunk"]) for w in late)

    def figure(key: str) -> str:
        return spread([w[key] for w in late], "{:.1f}")

    return (f"server-late chunks after the first: {len(late)}, at chunk (0-based) {dict(sorted(at.items()))}; "
            f"ms, median [min-max]: cut -> deadline {figure('budget_ms')}, codec queue wait {figure('queue_ms')}, "
            f"batch decode {figure('decode_ms')}, late by {figure('late_ms')}, "
            f"backlog estimated at the cut {figure('backlog_ms')}")


def gen2_census(top: int = 8) -> dict[str, Any]:
    """What a full collection would scan now: the oldest generation's size (frozen objects excluded) and its
    `top` most common types. Takes a few ms per 100k objects: call it between rounds, not during one."""
    objects = gc.get_objects(generation=2)
    kinds: dict[str, int] = {}
    for o in objects:
        name = f"{type(o).__module__}.{type(o).__qualname__}"
        kinds[name] = kinds.get(name, 0) + 1
    return {"objects": len(objects), "frozen": gc.get_freeze_count(),
            "top": sorted(kinds.items(), key=lambda kv: -kv[1])[:top]}


# -- clients (their own process) -------------------------------------------------------------------------

def run_clients(url: str, concurrency: int, text: str, initial: int | None = None, seed0: int = 0) -> dict[str, Any]:
    """C sessions at once (seeds `seed0 + i`), each sending `input.done` once all are configured; each
    stream's (time `input.done` was sent, [(arrival time, samples) of each binary frame], the server's
    `first_audio_ms`)."""
    return asyncio.run(_clients(url, concurrency, text, initial, seed0))


async def _clients(url: str, concurrency: int, text: str, initial: int | None, seed0: int) -> dict[str, Any]:
    import websockets

    async def one(index: int) -> tuple[float, list[tuple[float, int]], float | None]:
        async with websockets.connect(url, max_size=None, compression=None) as ws:
            config: dict[str, Any] = {"type": "session.config", "voice": "tara", "response_format": "pcm",
                                      "stream_audio": True, "split_granularity": "none", "seed": seed0 + index}
            if initial is not None:
                config["initial_codec_chunk_frames"] = initial
            await ws.send(json.dumps(config))
            while json.loads(await ws.recv())["type"] != "session.updated":
                pass
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            configured.append(index)
            if len(configured) == concurrency:
                ready.set()
            await ready.wait()
            sent = time.perf_counter()
            await ws.send(json.dumps({"type": "input.done"}))
            arrivals: list[tuple[float, int]] = []
            while True:
                frame = await ws.recv()
                if isinstance(frame, bytes):
                    arrivals.append((time.perf_counter(), len(frame) // 2))
                    continue
                message = json.loads(frame)
                if message["type"] in ("session.done", "error"):
                    return sent, arrivals, (message.get("timings") or {}).get("first_audio_ms")

    ready = asyncio.Event()
    configured: list[int] = []
    # The clients are the instrument: a collector pause here would misdate arrivals (one of 38.6 ms did, on
    # the H200). Their heap (this module's imports) is frozen and the collector is off for the round; the
    # pauses still recorded are those a round cannot avoid (none expected).
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        with GcPauses() as pauses:
            results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    finally:
        gc.enable()
    return {"streams": results, "gc_pauses_ms": pauses.ms}


# -- raw talker (on the server's loop) -------------------------------------------------------------------

async def raw_talker(engine: TalkerEngine, concurrency: int, text: str, tag: str) -> list[tuple[float, float]]:
    """C raw token streams at once: (ms to the first frame's 7 tokens, per-stream real-time factor)."""

    async def one(index: int) -> tuple[float, float]:
        request = SynthesisRequest(request_id=f"raw-{tag}-{index}", text=text, voice="tara", seed=index)
        began = time.perf_counter()
        first: float | None = None
        tokens = 0
        async for count in engine.talker_tokens(request):
            tokens += count
            if first is None and tokens >= CODES_PER_FRAME:
                first = time.perf_counter()
        wall = time.perf_counter() - began
        assert first is not None
        return (first - began) * 1000.0, wall / (tokens / CODES_PER_FRAME * FRAME_S)

    return list(await asyncio.gather(*(one(i) for i in range(concurrency))))


async def frontend_ms(engine: TalkerEngine, concurrency: int, text: str, tag: str) -> tuple[float, float]:
    """Run on the server's loop: ms from handing C requests (this level's units) to the engine at once until
    the last is in vLLM (`TalkerEngine.frontend_seconds`), vLLM's share of the "client -> engine call" stage
    of a burst; and the ms of CPU the loop's thread spent meanwhile (what the burst's other sessions wait for;
    the tokenizer's own thread not included)."""
    requests = [SynthesisRequest(request_id=f"frontend-{tag}-{index}", text=text, voice="tara", seed=index)
                for index in range(concurrency)]
    cpu = time.thread_time()
    wall = await engine.frontend_seconds(requests)
    return 1000.0 * wall, 1000.0 * (time.thread_time() - cpu)


# -- codec alone (CUDA) -----------------------------------------------------------------------------------

MICRO_SHAPES = ((1, 1), (1, 2), (1, 5), (8, 2), (64, 1), (64, 2), (64, 5), (32, 20), (64, 20))


def codec_micro(root: Path, sizes: dict[str, Any], max_batch: int) -> dict[str, Any]:
    """SNAC alone on the GPU: float32 eager (the previous engine) vs the engine's float16 CUDA graphs, ms per
    decode call (p50 of 20, the host copies and sync included), and float16's error on a noise-free decoder."""
    import numpy as np
    import torch
    from voicewire.adapters.talker_codec import SnacCodec

    folder = write_snac(root / "snac-quiet", {**sizes, "noise": False})
    rng = np.random.default_rng(0)
    timings: dict[str, dict[str, float]] = {}
    outputs: dict[str, Any] = {}
    probe = rng.integers(0, 4096, size=(4, 20, CODES_PER_FRAME), dtype=np.int64)
    for name, dtype, graphs in (("fp32_eager", "float32", False), ("fp16_graphs", "float16", True)):
        codec = SnacCodec(folder, "cuda", dtype, graphs)
        codec.load()
        began = time.perf_counter()
        codec.prepare(sorted({frames for _, frames in MICRO_SHAPES}), max_batch)
        timings[name] = {"prepare_s": time.perf_counter() - began, "graphs": codec.graph_shapes}
        for batch, frames in MICRO_SHAPES:
            codes = rng.integers(0, 4096, size=(batch, frames, CODES_PER_FRAME), dtype=np.int64)
            for _ in range(3):
                codec.decode(codes)
            spent = []
            for _ in range(20):
                t = time.perf_counter()
                codec.decode(codes)
                spent.append((time.perf_counter() - t) * 1000.0)
            timings[name][f"{batch}x{frames}"] = percentile(spent, 50)
        outputs[name] = codec.decode(probe)
        del codec
        torch.cuda.empty_cache()
    ref, got = outputs["fp32_eager"], outputs["fp16_graphs"]
    error = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return {"ms": timings, "fp16_rel_error": error, "fp16_max_abs_error": float(np.abs(got - ref).max())}


# -- main ------------------------------------------------------------------------------------------------

STAGES = (("client -> engine call", "sent", "call"), ("talker: call -> 1st output", "call", "first_output"),
          ("talker: 1st output -> 1st frame", "first_output", "first_frame"),
          ("codec queue wait", "queued", "decode_start"), ("codec decode", "decode_start", "decode_end"),
          ("decoded -> piece yielded", "decode_end", "yielded"), ("yielded -> client 1st byte", "yielded", "arrival"))


def stages(got: list[Any], trace: dict[str, dict[str, float]], seed0: int) -> dict[str, list[float]]:
    """Per stage, the ms of each stream whose trace is complete (paired by seed)."""
    by_seed = {int(t["seed"]): t for t in trace.values() if "yielded" in t}
    out: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for index, (sent, arrivals, _) in enumerate(got):
        t = by_seed.get(seed0 + index)
        if t is None:
            continue
        points = {**t, "sent": sent, "arrival": arrivals[0][0]}
        for name, a, b in STAGES:
            out[name].append((points[b] - points[a]) * 1000.0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,8,32,64,64:2,128",
                        help="levels, each C or C:I (I = initial_codec_chunk_frames every session asks for)")
    parser.add_argument("--shape", choices=("3b", "tiny"), default="3b")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--codec-dtype", default="auto")
    parser.add_argument("--no-codec-graphs", action="store_true")
    parser.add_argument("--no-micro", action="store_true", help="skip the codec micro-benchmark")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per level (after one warm-up)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no level or round once this many seconds have passed since the bench began")
    parser.add_argument("--frontend-only", action="store_true",
                        help="only vLLM's frontend per level and round (no sessions): C requests handed to vLLM "
                             "back to back, for levels a CPU cannot serve")
    args = parser.parse_args(argv)
    provenance = Provenance.begin()
    bench_began = time.perf_counter()
    levels = [(int(c.split(":")[0]), int(c.split(":")[1]) if ":" in c else None)
              for c in args.concurrency.split(",")]
    top = max(c for c, _ in levels)
    root = Path(tempfile.mkdtemp(prefix="talker-bench-"))
    big = args.shape == "3b"
    results: dict[str, Any] = {"shape": args.shape, "text_chars": len(TEXT), "levels": [],
                               "provenance": provenance.as_dict()}
    if not args.no_micro and _cuda():
        results["codec_micro"] = micro = codec_micro(root, SNAC_24KHZ if big else TINY_SNAC, 64)
        print(json.dumps(micro, indent=1), flush=True)
    config = TalkerConfig(
        talker_model=str(write_talker(root / "talker", LLAMA_3_2_3B if big else TINY_LLAMA)),
        codec_model=str(write_snac(root / "snac", SNAC_24KHZ if big else TINY_SNAC)),
        max_concurrency=2 * top, max_model_len=2048, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=not big, random_weights=True, max_frames=400, codec_dtype=args.codec_dtype,
        codec_cuda_graphs=not args.no_codec_graphs,
    )
    began = time.perf_counter()
    engine = TalkerEngine(config)
    sessions = 2 * top + 8
    server = ServerThread(Settings(engine="talker", max_sessions=sessions, max_sessions_per_ip=sessions,
                                   admission_utilization=0.0), engine, start_timeout_s=900)
    server.call(lambda: _until_ready(server), timeout=900)
    started_s = time.perf_counter() - began
    codec = engine._codec
    print(f"engine ready in {started_s:.0f} s (frames per unit: {engine.unit_frames(TEXT)}; codec {codec.device} "
          f"{codec.dtype}, {codec.graph_shapes} CUDA graphs)", flush=True)
    results.update(engine_start_s=started_s, unit_frames=engine.unit_frames(TEXT), codec_dtype=codec.dtype,
                   codec_graphs=codec.graph_shapes)
    rows: list[list[str]] = []
    stage_rows: list[list[str]] = []
    summary: list[list[Any]] = []

    def spent(what: str) -> bool:
        if args.budget_s is None or time.perf_counter() - bench_began <= args.budget_s:
            return False
        print(f"budget spent: stopped before {what}", flush=True)
        return True

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: print what ran, then stop
    try:
        if args.frontend_only:
            _frontend_levels(args, levels, engine, server, results, summary)
        else:
            _levels(args, levels, engine, server, codec, results, rows, stage_rows, summary, spent)
    finally:
        ended = provenance.end()
        results["provenance"] = ended.as_dict()
        print(ended.line())
        if args.frontend_only:
            print(table(["conc", "rounds", "vLLM frontend, C requests ms", "per request us", "of it the loop's CPU ms",
                         "loop CPU per request us"], summary), flush=True)
        else:
            _report(rows, stage_rows, summary)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "talker_gpu.json").write_text(json.dumps(results, indent=1))
        server.stop()
    return 0


def _frontend_levels(args: argparse.Namespace, levels: list[tuple[int, int | None]], engine: TalkerEngine,
                     server: ServerThread, results: dict[str, Any], summary: list[list[Any]]) -> None:
    """`--frontend-only`: per level one warm-up, then `--rounds` rounds of `frontend_ms`."""
    for number, (conc, _) in enumerate(levels):
        server.call(functools.partial(frontend_ms, engine, conc, TEXT, f"warm{number}"), timeout=600)
        spent = [server.call(functools.partial(frontend_ms, engine, conc, TEXT, f"f{number}r{round_}"),
                             timeout=600) for round_ in range(args.rounds)]
        spent_ms, loop_ms = [wall for wall, _ in spent], [cpu for _, cpu in spent]
        results["levels"].append({"concurrency": conc, "frontend_ms": spent_ms, "loop_cpu_ms": loop_ms})
        summary.append([conc, len(spent_ms), spread(spent_ms, "{:.1f}"),
                        spread([1000.0 * ms / conc for ms in spent_ms], "{:.0f}"), spread(loop_ms, "{:.1f}"),
                        spread([1000.0 * ms / conc for ms in loop_ms], "{:.0f}")])


def _levels(args: argparse.Namespace, levels: list[tuple[int, int | None]], engine: TalkerEngine,
            server: ServerThread, codec: Any, results: dict[str, Any], rows: list[list[str]],
            stage_rows: list[list[str]], summary: list[list[Any]], spent: Callable[[str], bool]) -> None:
    """Every level in turn: its warm-up round, then `--rounds` measured rounds, until the budget is spent."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        for number, (conc, initial) in enumerate(levels):
            label = f"{conc}" if initial is None else f"{conc} (1st chunk {initial})"
            if spent(f"concurrency {label}"):
                return
            clients.submit(run_clients, server.ws_url, conc, WARM_TEXT, initial).result()
            server.call(functools.partial(raw_talker, engine, conc, WARM_TEXT, f"warm{conc}"), timeout=600)
            rounds: list[dict[str, Any]] = []
            try:
                for round_ in range(args.rounds):
                    if round_ and spent(f"round {round_ + 1} at concurrency {label}"):
                        break
                    seed0 = 1000 * (args.rounds * number + round_ + 1)
                    before = engine.stats
                    census = gen2_census()
                    engine.trace(True)
                    with GcPauses() as pauses:
                        answer = clients.submit(run_clients, server.ws_url, conc, TEXT, initial, seed0).result()
                    got, client_pauses = answer["streams"], answer["gc_pauses_ms"]
                    trace = engine.trace(False)
                    after = engine.stats
                    raw = server.call(functools.partial(raw_talker, engine, conc, TEXT, f"m{number}r{round_}"),
                                      timeout=600)
                    frontend, _ = server.call(functools.partial(frontend_ms, engine, conc, TEXT,
                                                                f"m{number}r{round_}"), timeout=600)
                    streams = [play(sent, arrivals, SAMPLE_RATE) for sent, arrivals, _ in got]
                    first_sent = min(sent for sent, _, _ in got)
                    last_byte = max(arrivals[-1][0] for _, arrivals, _ in got)
                    split = stages(got, trace, seed0)
                    late = [dict(w, seed=t["seed"]) for t in trace.values() for w in late_windows(t)]
                    stall_at: dict[int, int] = {}
                    for st in streams:
                        for index in st.stall_chunks:
                            stall_at[index] = stall_at.get(index, 0) + 1
                    a, b = after.codec, before.codec
                    level = {
                        "concurrency": conc, "initial_frames": initial, "round": round_,
                        "ttfa_ms": [s.ttfa_ms for s in streams], "rtf": [s.rtf for s in streams],
                        "stall_s": [s.stall_s for s in streams], "stalls": [s.stalls for s in streams],
                        "stall_chunk_index": stall_at,
                        "audio_s_per_wall_s": sum(s.audio_s for s in streams) / (last_byte - first_sent),
                        "raw_first_frame_ms": [r[0] for r in raw], "raw_rtf": [r[1] for r in raw],
                        "server_first_audio_ms": [f for _, _, f in got if f is not None],
                        "stages_ms": split, "frontend_ms": frontend,
                        "codec_batches": a.batches - b.batches, "codec_windows": a.windows - b.windows,
                        "codec_decode_s": a.decode_s - b.decode_s, "codec_max_decode_ms": a.max_decode_ms,
                        "codec_late_windows": a.late - b.late, "codec_max_batch": a.max_batch,
                        "codec_fallbacks": codec.fallbacks, "peak_running": after.steps.peak_running,
                        "gc_pauses_ms": pauses.ms, "gc_full": pauses.full, "gen2_before": census,
                        "client_gc_pauses_ms": client_pauses, "chunks": [len(a) for _, a, _ in got],
                        "late_windows": late,
                    }
                    results["levels"].append(level)
                    rounds.append(level)
                    ttfa, raw_first = level["ttfa_ms"], level["raw_first_frame_ms"]
                    stalled = [s for s in streams if s.stalls]
                    worst = max((s.stall_s for s in streams), default=0.0)
                    rows.append([f"{label} r{round_ + 1}", f"{percentile(ttfa, 50):.0f} / {percentile(ttfa, 95):.0f}",
                                 f"{percentile(raw_first, 50):.0f}",
                                 f"{percentile(ttfa, 50) / percentile(raw_first, 50):.2f}",
                                 f"{percentile(level['rtf'], 50):.3f}", f"{percentile(level['raw_rtf'], 50):.3f}",
                                 f"{len(stalled)} of {conc}",
                                 f"{sum(s.stall_s for s in streams):.2f} (max {1000 * worst:.0f} ms)",
                                 ",".join(f"#{k}:{v}" for k, v in sorted(stall_at.items())) or "-",
                                 f"{level['audio_s_per_wall_s']:.1f}",
                                 f"{level['codec_windows'] / max(level['codec_batches'], 1):.1f}",
                                 f"{1000 * level['codec_decode_s'] / max(level['codec_batches'], 1):.1f}",
                                 f"{len(pauses.ms)} (max {max(pauses.ms, default=0.0):.1f} ms)",
                                 f"{len(pauses.full)} (max {max((f[0] for f in pauses.full), default=0.0):.1f} ms)",
                                 f"{census['objects']}",
                                 f"{len(client_pauses)} (max {max(client_pauses, default=0.0):.1f} ms)"])
                    stalled_at: list[float] = []
                    from_end: dict[int, int] = {}
                    for st, (_, arrivals, _) in zip(streams, got, strict=True):
                        for i in st.stall_chunks:
                            stalled_at.append(arrivals[i][0])
                            from_end[i - len(arrivals)] = from_end.get(i - len(arrivals), 0) + 1
                    if late:
                        print(f"  {late_summary(late)}", flush=True)
                    if from_end:
                        print(f"  late chunks by place from the stream's end (-1: its last): "
                              f"{dict(sorted(from_end.items()))}; chunks per stream "
                              f"{spread([float(len(a)) for _, a, _ in got], '{:.0f}')}", flush=True)
                    for ms, collected, thread, began in pauses.full:
                        near = sum(1 for t in stalled_at if began <= t <= began + 0.5)
                        print(f"  full collection: {ms:.1f} ms, {collected} collected, thread {thread}; "
                              f"{near} of the round's {len(stalled_at)} late chunks arrived within 0.5 s after it; "
                              f"oldest generation before the round: {census['objects']} objects, "
                              f"{census['frozen']} frozen; most common {census['top'][:4]}", flush=True)
                    stage_rows.append([f"{label} r{round_ + 1}",
                                       *(f"{percentile(split[name], 50):.1f}" for name, _, _ in STAGES),
                                       f"{percentile(level['server_first_audio_ms'], 50):.1f}", f"{frontend:.1f}"])
            finally:  # a level cut short (budget, SIGTERM) keeps its summary row
                if rounds:
                    summary.append([label, len(rounds), spread([percentile(r["ttfa_ms"], 50) for r in rounds]),
                                    spread([percentile(r["ttfa_ms"], 95) for r in rounds]),
                                    spread([percentile(r["rtf"], 50) for r in rounds], "{:.3f}"),
                                    " ".join(str(sum(1 for n in r["stalls"] if n)) for r in rounds),
                                    " ".join(f"{sum(r['stall_s']):.2f}" for r in rounds),
                                    spread([r["audio_s_per_wall_s"] for r in rounds], "{:.1f}"),
                                    spread([percentile(r["stages_ms"]["client -> engine call"], 95) for r in rounds],
                                           "{:.1f}"),
                                    spread([r["frontend_ms"] for r in rounds], "{:.1f}")])
            print(f"concurrency {label} done", flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "talker_gpu.json").write_text(json.dumps(results, indent=1))


def _report(rows: list[list[str]], stage_rows: list[list[str]], summary: list[list[Any]]) -> None:
    header = ["conc", "TTFA p50 / p95 ms", "raw talker 1st frame p50 ms", "TTFA / raw", "RTF p50",
              "raw talker RTF p50", "streams with a stall", "total stall s", "stalls at chunk #:streams",
              "audio s per wall s", "chunks per codec batch", "ms per codec batch",
              "server GC pauses", "of them full", "oldest generation before",
              "client GC pauses"]
    print(table(header, rows))
    print()
    print("first-chunk stages, p50 ms:")
    print(table(["conc", *(name for name, _, _ in STAGES), "server commit -> socket",
                 "vLLM frontend, C requests (ms, not p50)"], stage_rows))
    print()
    print("summary over rounds: median [min-max] of each round's figure; stalls listed per round")
    print(table(["conc", "rounds", "TTFA p50 ms", "TTFA p95 ms", "RTF p50", "streams with a stall, per round",
                 "stall s, per round", "audio s per wall s", "client -> engine call p95 ms",
                 "vLLM frontend, C requests ms"], summary), flush=True)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


async def _until_ready(server: ServerThread) -> None:
    while server.state.context is None:
        await asyncio.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
