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

Beside it, the raw talker: the same units' token streams straight from the engine's `AsyncLLM`
(`TalkerEngine.talker_tokens`, no codec, no server), C at once: time to the first frame's 7 tokens and the
per-stream frame rate as a real-time factor. The ratio of the two TTFAs is what the serving path adds.

Run from the repository root: `python -m bench.talker_gpu --out DIR` (see `--help`; `--shape tiny` runs the
same path on the CPU in a few minutes). Results: docs/benchmarks.md, "Talker on GPU".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voicewire.adapters.base import SynthesisRequest
from voicewire.adapters.talker import TalkerConfig, TalkerEngine
from voicewire.adapters.talker_layout import CODES_PER_FRAME, SAMPLE_RATE, SAMPLES_PER_FRAME
from voicewire.adapters.talker_testing import LLAMA_3_2_3B, SNAC_24KHZ, TINY_LLAMA, TINY_SNAC, write_snac, write_talker
from voicewire.realtime.settings import Settings

from bench.workload import percentile, table
from tests.server import ServerThread

TEXT = ("Your flight to Tokyo departs from gate B twelve at noon, and boarding begins forty minutes earlier, "
        "so please have your passport and boarding pass ready.")
"""153 characters: 115 frames, 9.8 s of audio in random-weight mode."""
WARM_TEXT = "Warm up this concurrency level, please."
FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE


@dataclass(frozen=True, slots=True)
class Stream:
    """One client's view of one utterance."""

    ttfa_ms: float
    audio_s: float
    rtf: float
    stall_s: float
    stalls: int


def play(sent_at: float, arrivals: list[tuple[float, int]]) -> Stream:
    """Replay arrivals (time, samples) through a player that starts at the first byte."""
    start = arrivals[0][0]
    played_until = start
    stall_s, stalls = 0.0, 0
    for at, samples in arrivals:
        if at > played_until:
            stall_s += at - played_until
            stalls += 1
            played_until = at
        played_until += samples / SAMPLE_RATE
    audio_s = sum(n for _, n in arrivals) / SAMPLE_RATE
    return Stream((start - sent_at) * 1000.0, audio_s, (arrivals[-1][0] - sent_at) / audio_s, stall_s, stalls)


# -- clients (their own process) -------------------------------------------------------------------------

def run_clients(url: str, concurrency: int, text: str) -> dict[str, Any]:
    """C sessions at once, each sending `input.done` once all are configured; each stream's (time
    `input.done` was sent, [(arrival time, samples) of each binary frame])."""
    return asyncio.run(_clients(url, concurrency, text))


async def _clients(url: str, concurrency: int, text: str) -> dict[str, Any]:
    import websockets

    async def one(index: int) -> tuple[float, list[tuple[float, int]]]:
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "tara", "response_format": "pcm",
                                      "stream_audio": True, "split_granularity": "none", "seed": index}))
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
                elif json.loads(frame)["type"] in ("session.done", "error"):
                    return sent, arrivals

    ready = asyncio.Event()
    configured: list[int] = []
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return {"streams": results}


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


# -- main ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,8,32,64,128")
    parser.add_argument("--shape", choices=("3b", "tiny"), default="3b")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    root = Path(tempfile.mkdtemp(prefix="talker-bench-"))
    big = args.shape == "3b"
    config = TalkerConfig(
        talker_model=str(write_talker(root / "talker", LLAMA_3_2_3B if big else TINY_LLAMA)),
        codec_model=str(write_snac(root / "snac", SNAC_24KHZ if big else TINY_SNAC)),
        max_concurrency=2 * max(levels), max_model_len=2048, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=not big, random_weights=True, max_frames=400,
    )
    began = time.perf_counter()
    engine = TalkerEngine(config)
    sessions = 2 * max(levels) + 8
    server = ServerThread(Settings(engine="talker", max_sessions=sessions, max_sessions_per_ip=sessions), engine)
    server.call(lambda: _until_ready(server), timeout=900)
    started_s = time.perf_counter() - began
    print(f"engine ready in {started_s:.0f} s (frames per unit: {engine.unit_frames(TEXT)})", flush=True)
    results: dict[str, Any] = {"shape": args.shape, "engine_start_s": started_s, "text_chars": len(TEXT),
                               "unit_frames": engine.unit_frames(TEXT), "levels": []}
    rows = []
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        for conc in levels:
            clients.submit(run_clients, server.ws_url, conc, WARM_TEXT).result()
            server.call(lambda c=conc: raw_talker(engine, c, WARM_TEXT, f"warm{c}"), timeout=600)
            before = engine.stats
            got = clients.submit(run_clients, server.ws_url, conc, TEXT).result()
            after = engine.stats
            raw = server.call(lambda c=conc: raw_talker(engine, c, TEXT, f"m{c}"), timeout=600)
            streams = [play(sent, arrivals) for sent, arrivals in got["streams"]]
            first_sent = min(sent for sent, _ in got["streams"])
            last_byte = max(arrivals[-1][0] for _, arrivals in got["streams"])
            level = {
                "concurrency": conc,
                "ttfa_ms": [s.ttfa_ms for s in streams], "rtf": [s.rtf for s in streams],
                "stall_s": [s.stall_s for s in streams], "stalls": [s.stalls for s in streams],
                "audio_s_per_wall_s": sum(s.audio_s for s in streams) / (last_byte - first_sent),
                "raw_first_frame_ms": [r[0] for r in raw], "raw_rtf": [r[1] for r in raw],
                "codec_batches": after.codec.batches - before.codec.batches,
                "codec_windows": after.codec.windows - before.codec.windows,
                "codec_max_batch": after.codec.max_batch, "peak_running": after.peak_running,
            }
            results["levels"].append(level)
            ttfa, raw_first = level["ttfa_ms"], level["raw_first_frame_ms"]
            rows.append([conc, f"{percentile(ttfa, 50):.0f} / {percentile(ttfa, 95):.0f}",
                         f"{percentile(raw_first, 50):.0f}", f"{percentile(ttfa, 50) / percentile(raw_first, 50):.2f}",
                         f"{percentile(level['rtf'], 50):.3f}", f"{percentile(level['raw_rtf'], 50):.3f}",
                         f"{sum(1 for s in streams if s.stalls)} of {conc}", f"{sum(s.stall_s for s in streams):.2f}",
                         f"{level['audio_s_per_wall_s']:.1f}",
                         f"{level['codec_windows'] / max(level['codec_batches'], 1):.1f}"])
            print(f"concurrency {conc} done", flush=True)
    server.stop()
    header = ["conc", "TTFA p50 / p95 ms", "raw talker 1st frame p50 ms", "TTFA / raw", "RTF p50",
              "raw talker RTF p50", "streams with a stall", "total stall s", "audio s per wall s",
              "chunks per codec batch"]
    print(table(header, rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "talker_gpu.json").write_text(json.dumps(results, indent=1))
    return 0


async def _until_ready(server: ServerThread) -> None:
    while not server.ctx.ready:
        await asyncio.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
