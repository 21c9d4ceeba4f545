"""`kill -9` of the server at any moment of a voice upload leaves no partial file, no half voice."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import soundfile as sf
from safetensors import safe_open

from tests.server import free_port


def sample_wav(seconds: float = 3.0) -> bytes:
    t = np.arange(int(24000 * seconds)) / 24000
    audio = (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, audio, 24000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def start(voices: Path, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "voicewire.realtime", "--port", str(port), "--no-auth",
                             "--engine-isolation", "thread", "--voices-dir", str(voices)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_ready(session: aiohttp.ClientSession, base: str) -> None:
    async with asyncio.timeout(120):
        while True:
            try:
                async with session.get(f"{base}/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)


async def upload(session: aiohttp.ClientSession, base: str, name: str, wav: bytes) -> int:
    form = aiohttp.FormData()
    form.add_field("name", name)
    form.add_field("consent", "I own this voice and consent to its use")
    form.add_field("audio_sample", wav, filename=f"{name}.wav", content_type="audio/wav")
    async with session.post(f"{base}/v1/audio/voices", data=form) as resp:
        await resp.read()
        return resp.status


async def test_kill_9_during_uploads_then_restart_finds_only_whole_voices(tmp_path: Path) -> None:
    voices = tmp_path / "voices"
    wav = sample_wav()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    completed: set[str] = set()
    async with aiohttp.ClientSession() as session:
        for round_, delay in enumerate((0.0, 0.005, 0.02, 0.04, 0.06, 0.08, 0.12, 0.2)):
            proc = start(voices, port)
            try:
                await wait_ready(session, base)
                tasks = [asyncio.create_task(upload(session, base, f"voice{round_}_{i}", wav)) for i in range(6)]
                await asyncio.sleep(delay)
                os.kill(proc.pid, signal.SIGKILL)
                for i, task in enumerate(tasks):
                    try:
                        if await task == 200:
                            completed.add(f"voice{round_}_{i}")
                    except aiohttp.ClientError:
                        pass
            finally:
                proc.kill()
                proc.wait(10)
        proc = start(voices, port)
        try:
            await wait_ready(session, base)
            async with session.get(f"{base}/v1/audio/voices") as resp:
                listed = {v["name"] for v in (await resp.json())["uploaded_voices"]}
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    on_disk = sorted(voices.iterdir())
    assert all(p.suffix == ".safetensors" and not p.name.startswith(".") for p in on_disk), on_disk
    assert {p.stem for p in on_disk} == listed
    assert completed <= listed, "every upload the server acknowledged survived the crash"
    for path in on_disk:
        with safe_open(str(path), "np") as f:
            audio = f.get_tensor("audio")
            meta = f.metadata()
        assert meta["name"] == path.stem
        assert 1.0 <= len(audio) / int(meta["sample_rate"]) <= 30.0
