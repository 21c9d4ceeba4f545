"""Resume after a network blip: time from reconnecting to the first replayed byte, and how much the server
had to keep (the replay buffer) as the outage grows.

One real server (`tests.server.ServerThread`, the real engine) and a TCP proxy (`tests.proxy.Proxy`) that
cuts the connection, with no close handshake, once the first audio of a long answer has arrived and the
server has the client's `session.ack` of it. The client stays away for the outage, then opens a new
WebSocket with `?session_id=`, sends `session.resume`, and times:

- reconnect to first replayed byte: from starting the new connection (TCP + upgrade + `session.resume`)
  to the first binary frame replayed;
- replay: frames and bytes the server replayed (what it kept while the client was away; it synthesizes
  only the units in flight, up to `replay_buffer_bytes`);
- after replay: audio that arrived after the replayed frames (synthesized once the client was back);
- within cap: rounds whose replay was at most `replay_buffer_bytes` plus one frame (the largest frame of
  the answer); whole audio: rounds whose audio (before the cut, replayed, after) is byte-identical to an
  uncut run of the same answer with the same seed (nothing lost or repeated).

Each round runs every outage once; the table shows, per outage, median [min-max] over the rounds.
`--replay-buffer-bytes` below the audio of the units in flight (e.g. 65536, half a sentence) shows the
cap reached: the replay stays there however long the outage, and the rest of the answer follows the resume.

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

from bench.workload import Provenance, spread, table
from tests.proxy import Proxy
from tests.server import ServerThread

ANSWER = " ".join(f"This is sentence number {n} of a long answer, spoken while the network comes and goes."
                  for n in range(1, 13))
CONFIG = {"type": "session.config", "split_granularity": "sentence", "response_format": "pcm",
          "stream_audio": True, "audio_frames": "binary", "seed": 1}


async def reference(server: ServerThread) -> list[str | bytes]:
    """Every frame of `ANSWER` spoken on one uncut connection (no `session.ack`: not resumable)."""
    frames: list[str | bytes] = []
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        await ws.send(json.dumps(CONFIG))
        await ws.send(json.dumps({"type": "input.text", "text": ANSWER}))
        await ws.send(json.dumps({"type": "input.done"}))
        while True:
            frame = await ws.recv()
            frames.append(frame)
            if isinstance(frame, str) and json.loads(frame)["type"] == "session.done":
                break
        await ws.send(json.dumps({"type": "session.close"}))
    return frames


async def acknowledged(server: ServerThread, session_id: str, seq: int) -> None:
    """Until the server has applied the client's `session.ack` of frame `seq` (so every cut comes at the
    same point: the client has received and acknowledged the first audio, the rest is the replay's)."""
    async def forgotten() -> bool:
        return any(s.session_id == session_id and s.replay.first_seq > seq for s in server.ctx.sessions)
    async with asyncio.timeout(30):
        while not await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(forgotten(), server.loop)):
            await asyncio.sleep(0.005)


async def one(server: ServerThread, outage_s: float, uncut: list[str | bytes]) -> dict[str, Any]:
    """Speak `ANSWER`, cut after the first audio, wait `outage_s`, resume; time it, read the replay and
    compare the audio with `uncut`."""
    audio: list[bytes] = []
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
                audio.append(frame)
                break
        await acknowledged(server, updated["session_id"], seq)
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
        received = 0
        after_replay = 0
        while True:
            frame = await again.recv()
            seq += 1
            received += 1
            await again.send(json.dumps({"type": "session.ack", "seq": seq}))
            if isinstance(frame, bytes):
                audio.append(frame)
                if first_ms is None:
                    first_ms = (time.perf_counter() - started) * 1000.0
                if received > resumed["replay_frames"]:
                    after_replay += len(frame)
            if isinstance(frame, str) and json.loads(frame)["type"] == "session.done":
                break
        await again.send(json.dumps({"type": "session.close"}))
    cap = server.settings.replay_buffer_bytes
    largest = max(map(size, uncut))
    return {"outage_s": outage_s, "first_replayed_byte_ms": round(first_ms or 0.0, 2),
            "replay_frames": resumed["replay_frames"], "replay_kib": round(resumed["replay_bytes"] / 1024, 1),
            "after_replay_kib": round(after_replay / 1024, 1),
            "within_cap": resumed["replay_bytes"] <= cap + largest,
            "whole_audio": b"".join(audio) == b"".join(f for f in uncut if isinstance(f, bytes))}


def size(frame: str | bytes) -> int:
    return len(frame) if isinstance(frame, bytes) else len(frame.encode())


FIGURES = {"first_replayed_byte_ms": "{:.1f}", "replay_frames": "{:.0f}", "replay_kib": "{:.1f}",
           "after_replay_kib": "{:.1f}"}
CHECKS = ("within_cap", "whole_audio")


async def run(outages: list[float], rounds: int, replay_buffer_bytes: int
              ) -> tuple[list[str | bytes], dict[float, list[dict[str, Any]]]]:
    """The uncut reference, then every outage once per round (interleaved, so a slow spell of the machine
    hits all of them)."""
    server = ServerThread(Settings(admission_utilization=0, replay_buffer_bytes=replay_buffer_bytes))
    try:
        uncut = await reference(server)
        runs: dict[float, list[dict[str, Any]]] = {outage: [] for outage in outages}
        for _ in range(rounds):
            for outage in outages:
                runs[outage].append(await one(server, outage, uncut))
        return uncut, runs
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outages", default="0,0.5,2,5,10", help="outage lengths in seconds, comma-separated "
                        f"(each below the resume window, {Settings().resume_window_s:g} s)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per outage, reported as median [min-max]")
    parser.add_argument("--replay-buffer-bytes", type=int, default=Settings().replay_buffer_bytes,
                        help="the server's replay_buffer_bytes (default %(default)s)")
    args = parser.parse_args()
    provenance = Provenance.begin()
    uncut, runs = asyncio.run(run([float(x) for x in args.outages.split(",")], args.rounds,
                                  args.replay_buffer_bytes))
    audio = [f for f in uncut if isinstance(f, bytes)]
    print(provenance.end().line())
    print(f"replay_buffer_bytes {args.replay_buffer_bytes / 1024:.1f} KiB; the uncut answer: {len(uncut)} frames, "
          f"{sum(map(len, audio)) / 1024:.1f} KiB of audio, largest frame {max(map(size, uncut)) / 1024:.1f} KiB")
    print(f"median [min-max] over {args.rounds} rounds; checks: rounds that passed")
    rows = [[f"{outage:g}", *(spread([r[k] for r in rs], fmt) for k, fmt in FIGURES.items()),
             *(f"{sum(r[k] for r in rs)}/{len(rs)}" for k in CHECKS)]
            for outage, rs in runs.items()]
    print(table(["outage_s", *FIGURES, *CHECKS], rows))


if __name__ == "__main__":
    main()
