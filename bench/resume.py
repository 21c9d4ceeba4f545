"""Resume after a network blip: time from reconnecting to the first replayed byte, and how much the server
had to keep (the replay buffer) as the outage grows.

One real server (`tests.server.ServerThread`, the real engine) and a TCP proxy (`tests.proxy.Proxy`) that
cuts the connection, with no close handshake, right after the first audio of a long answer arrives. The
client stays away for the outage, then opens a new WebSocket with `?session_id=`, sends
`session.resume`, and times:

- reconnect to first replayed byte: from starting the new connection (TCP + upgrade + `session.resume`)
  to the first binary frame replayed;
- replay: frames and bytes the server replayed (what it kept while the client was away; it synthesizes
  only the units in flight, up to `replay_buffer_bytes`).

Each round runs every outage once; the table shows, per outage, median [min-max] over the rounds.

Run from the repository root: `python -m bench.resume` (see `--help`; docs/benchmarks.md has results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import websockets
from voicewire.realtime.settings import Settings

from bench.workload import spread, table
from tests.proxy import Proxy
from tests.server import ServerThread

ANSWER = " ".join(f"This is sentence number {n} of a long answer, spoken while the network comes and goes."
                  for n in range(1, 13))
CONFIG = {"type": "session.config", "split_granularity": "sentence", "response_format": "pcm",
          "stream_audio": True, "audio_frames": "binary", "seed": 1}


async def one(server: ServerThread, outage_s: float) -> dict[str, Any]:
    """Speak `ANSWER`, cut after the first audio, wait `outage_s`, resume; time it and read the replay."""
    async with Proxy(server.port) as proxy:
        ws = await websockets.connect(proxy.url(), max_size=None)
        await ws.send(json.dumps(CONFIG))
        updated = json.loads(await ws.recv())
        seq = 1
        await ws.send(json.dumps({"type": "session.ack", "seq": seq}))
        await ws.send(json.dumps({"type": "input.text", "text": ANSWER}))
        await ws.send(json.dumps({"type": "input.done"}))
        while True:
            frame = await ws.recv()
            seq += 1
            await ws.send(json.dumps({"type": "session.ack", "seq": seq}))
            if isinstance(frame, bytes):
                break
        proxy.abort()
    await asyncio.sleep(outage_s)
    started = time.perf_counter()
    sid = updated["session_id"]
    async with websockets.connect(f"{server.ws_url}?session_id={sid}", max_size=None) as again:
        await again.send(json.dumps({"type": "session.resume", "session_id": sid,
                                     "token": updated["resume_token"], "seq": seq}))
        resumed = json.loads(await again.recv())
        assert resumed["type"] == "session.resumed", resumed
        first_ms = None
        while True:
            frame = await again.recv()
            seq += 1
            await again.send(json.dumps({"type": "session.ack", "seq": seq}))
            if isinstance(frame, bytes) and first_ms is None:
                first_ms = (time.perf_counter() - started) * 1000.0
            if isinstance(frame, str) and json.loads(frame)["type"] == "session.done":
                break
        await again.send(json.dumps({"type": "session.close"}))
    return {"outage_s": outage_s, "first_replayed_byte_ms": round(first_ms or 0.0, 2),
            "replay_frames": resumed["replay_frames"], "replay_kib": round(resumed["replay_bytes"] / 1024, 1)}


FIGURES = {"first_replayed_byte_ms": "{:.1f}", "replay_frames": "{:.0f}", "replay_kib": "{:.1f}"}


async def run(outages: list[float], rounds: int) -> dict[float, list[dict[str, Any]]]:
    """Every outage once per round (interleaved, so a slow spell of the machine hits all of them)."""
    server = ServerThread(Settings(admission_utilization=0))
    try:
        runs: dict[float, list[dict[str, Any]]] = {outage: [] for outage in outages}
        for _ in range(rounds):
            for outage in outages:
                runs[outage].append(await one(server, outage))
        return runs
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outages", default="0,0.25,0.5,1,2", help="outage lengths in seconds, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="runs per outage, reported as median [min-max]")
    args = parser.parse_args()
    runs = asyncio.run(run([float(x) for x in args.outages.split(",")], args.rounds))
    print(f"median [min-max] over {args.rounds} rounds")
    rows = [[f"{outage:g}", *(spread([r[k] for r in rs], fmt) for k, fmt in FIGURES.items())]
            for outage, rs in runs.items()]
    print(table(["outage_s", *FIGURES], rows))


if __name__ == "__main__":
    main()
