"""Hostile voice uploads: description formats that point elsewhere, decompression bombs, lying types,
oversized form parts, a full disk. Each is refused cleanly (an OpenAI-shaped error), opens no socket and
no file, stores nothing, and leaves the server serving."""

from __future__ import annotations

import asyncio
import io
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import pytest
import soundfile as sf
from safetensors import safe_open
from safetensors.numpy import save as safetensors_bytes
from voicewire.protocol.media import MAX_OUTPUT_RATE
from voicewire.realtime.voices import MAX_SECONDS, VoiceStore

from tests.server import ServerThread, free_port
from tests.test_voice_store_crash import start, wait_ready
from tests.test_voices import VOICES, on_disk, settings_for, upload, wav_bytes


def flac_silence(seconds: float, rate: int, channels: int) -> bytes:
    """A FLAC file of `seconds` of digital silence: a few KB however long it is (FLAC codes it as constant
    subframes), written a second at a time so the test never holds the decoded audio itself."""
    buffer = io.BytesIO()
    with sf.SoundFile(buffer, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as f:
        block = np.zeros((rate, channels), np.int16)
        whole = int(seconds)
        for _ in range(whole):
            f.write(block)
        f.write(block[: int((seconds - whole) * rate)])
    return buffer.getvalue()


def wav_silence(seconds: float, rate: int, channels: int) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros((int(seconds * rate), channels), np.int16), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def udp_ports_bound() -> set[int]:
    """Local ports of every UDP socket on this host (all processes), from /proc/net/udp{,6}."""
    ports: set[int] = set()
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                ports.add(int(line.split()[1].rsplit(":", 1)[1], 16))
    return ports


class Loopback:
    """A TCP listener and a UDP port on 127.0.0.1 that a hostile file points at, watched while one
    upload runs: `connections` counts TCP connections accepted, `udp_bound` whether anyone bound the UDP
    port (the server would, to receive the RTP stream a session description announces)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.tcp_port = int(self._listener.getsockname()[1])
        self.udp_port = free_udp_port_pair()
        self.connections = 0
        self.udp_bound = False
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept), threading.Thread(target=self._watch_udp)]

    def __enter__(self) -> Loopback:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def _watch_udp(self) -> None:
        while not self._stop.is_set():
            if self.udp_port in udp_ports_bound():
                self.udp_bound = True
            self._stop.wait(0.01)


def free_udp_port_pair() -> int:
    """An even UDP port P with P and P+1 free (RTP and RTCP)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1]) & ~1
        if not {port, port + 1} & udp_ports_bound():
            return port


def sdp(net: Loopback) -> bytes:
    return (f"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=voice\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            f"m=audio {net.udp_port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n").encode()


def hls(net: Loopback) -> bytes:
    return (f"#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:10\n#EXT-X-MEDIA-SEQUENCE:0\n#EXTINF:10.0,\n"
            f"http://127.0.0.1:{net.tcp_port}/voice.ts\n#EXT-X-ENDLIST\n").encode()


def dash(net: Loopback) -> bytes:
    return (f'<?xml version="1.0"?><MPD xmlns="urn:mpeg:dash:schema:mpd:2011" type="static" '
            f'mediaPresentationDuration="PT10S" minBufferTime="PT1S" '
            f'profiles="urn:mpeg:dash:profile:isoff-on-demand:2011"><Period><AdaptationSet mimeType="audio/mp4">'
            f'<Representation id="a" bandwidth="64000" codecs="mp4a.40.2" audioSamplingRate="16000">'
            f"<BaseURL>http://127.0.0.1:{net.tcp_port}/voice.mp4</BaseURL></Representation></AdaptationSet>"
            f"</Period></MPD>").encode()


def concat(net: Loopback) -> bytes:
    return b"ffconcat version 1.0\nfile 'private.wav'\n"


def sdp_behind_id3(net: Loopback) -> bytes:
    """An ID3 tag (what an mp3 starts with) in front of a session description."""
    body = sdp(net)
    return b"ID3\x04\x00\x00\x00\x00\x00\x00" + body


HOSTILE = {"sdp": sdp, "hls": hls, "dash": dash, "concat": concat, "sdp behind id3": sdp_behind_id3}


@pytest.fixture
def voice_server(voices_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(settings_for(voices_dir))
    yield srv
    srv.stop()


@pytest.fixture
def voices_dir(tmp_path: Path) -> Path:
    return tmp_path / "voices"


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_description_format_is_refused_without_opening_anything(
        voice_server: ServerThread, voices_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        kind: str) -> None:
    # A file the server can read, next to where a relative path in a concat list would resolve.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "private.wav").write_bytes(wav_bytes(2.0))
    with Loopback() as net:
        response = upload(voice_server, "hostile", HOSTILE[kind](net))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_audio"
    assert response.json()["error"]["param"] == "audio_sample"
    assert net.connections == 0, "the server connected to a URL named in an upload"
    assert not net.udp_bound, "the server bound a UDP port named in an upload"
    assert on_disk(voices_dir) == []
    assert httpx.get(voice_server.http_url + VOICES).json()["uploaded_voices"] == []


def vm_hwm_bytes(pid: int) -> int:
    """Peak resident memory of a process so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def post_sample(session: aiohttp.ClientSession, base: str, name: str, sample: bytes) -> tuple[int, str]:
    form = aiohttp.FormData()
    form.add_field("name", name)
    form.add_field("consent", "mine")
    form.add_field("audio_sample", sample, filename="sample.flac", content_type="audio/flac")
    async with session.post(f"{base}/v1/audio/voices", data=form) as resp:
        return resp.status, (await resp.json())["error"]["code"] if resp.status != 200 else ""


STORED_CAP = int(MAX_SECONDS * MAX_OUTPUT_RATE * 4) + 64 * 1024
"""The most bytes one stored voice takes: 30 s of mono float32 at 48 kHz, plus the header."""


async def test_decompression_bombs_are_bounded_while_decoding(tmp_path: Path) -> None:
    """Four 45 KB files that each decode to 45 M samples (29 s, 8 channels, 192 kHz) and one 20-minute
    file at once: the server's peak memory grows by tens of MB, not the gigabytes a full decode takes;
    what is stored is mono at 48 kHz at most; the long one is refused; the server keeps serving."""
    voices = tmp_path / "voices"
    wide = flac_silence(29.0, 192_000, 8)
    long = flac_silence(20 * 60, 48_000, 1)
    assert len(wide) < 100_000 and len(long) < 300_000
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(voices, port)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, base)
            before = vm_hwm_bytes(proc.pid)
            results = await asyncio.gather(*(post_sample(session, base, f"wide{i}", wide) for i in range(4)),
                                           post_sample(session, base, "long", long))
            grown = vm_hwm_bytes(proc.pid) - before
            async with session.get(f"{base}/v1/audio/voices") as resp:
                listed = sorted(v["name"] for v in (await resp.json())["uploaded_voices"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert results == [(200, "")] * 4 + [(400, "invalid_audio_duration")]
    assert listed == [f"wide{i}" for i in range(4)]
    assert grown < 150 * 2**20, f"peak memory grew by {grown / 2**20:.0f} MiB"
    for path in voices.iterdir():
        assert path.stat().st_size <= STORED_CAP, path


@pytest.mark.parametrize(("case", "sample", "message"), [
    ("sample rate over the cap", flac_silence(2.0, 384_000, 1), "sample rate of 384000 Hz"),
    ("too many channels", wav_silence(1.5, 8000, 16), "16 channels"),
])
def test_audio_outside_the_published_bounds_is_refused(voice_server: ServerThread, voices_dir: Path, case: str,
                                                       sample: bytes, message: str) -> None:
    response = upload(voice_server, "bounded", sample)
    assert response.status_code == 400, case
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_audio", "audio_sample") and message in error["message"]
    assert on_disk(voices_dir) == []


def test_the_stored_type_is_the_detected_one_not_the_claimed_one(voice_server: ServerThread) -> None:
    response = upload(voice_server, "typed", wav_bytes(1.5), mime="text/html<script>alert(1)</script>")
    assert response.status_code == 200, response.text
    assert response.json()["voice"]["mime_type"] == "audio/wav"
    listing = httpx.get(voice_server.http_url + VOICES).json()
    assert [v["mime_type"] for v in listing["uploaded_voices"]] == ["audio/wav"]


def test_unknown_form_parts_are_bounded(voice_server: ServerThread, voices_dir: Path) -> None:
    big = httpx.post(voice_server.http_url + VOICES, timeout=60,
                     files={"audio_sample": ("s.wav", wav_bytes(1.5), "audio/wav"),
                            "padding": ("p.bin", b"\x00" * (4 * 2**20), "application/octet-stream")},
                     data={"name": "padded", "consent": "mine"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "upload_too_large", big.text
    many = httpx.post(voice_server.http_url + VOICES, timeout=60,
                      files=[("audio_sample", ("s.wav", wav_bytes(1.5), "audio/wav")),
                             *((f"extra{i}", (None, "x")) for i in range(100))],
                      data={"name": "padded", "consent": "mine"})
    assert many.status_code == 413 and many.json()["error"]["code"] == "upload_too_large", many.text
    assert on_disk(voices_dir) == []
    ok = upload(voice_server, "padded", wav_bytes(1.5), note="an unknown small field is ignored")
    assert ok.status_code == 200, ok.text


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 128 KiB tmpfs: room for one 1.2 s voice at 16 kHz (77 KB), not for a 3 s one (192 KB)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_a_507_that_leaves_nothing_and_keeps_serving(small_disk: Path) -> None:
    srv = ServerThread(settings_for(small_disk))
    try:
        full = upload(srv, "too_big", wav_bytes(3.0))
        assert full.status_code == 507, full.text
        error = full.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "insufficient_storage")
        assert on_disk(small_disk) == []
        assert httpx.get(srv.http_url + VOICES).json()["uploaded_voices"] == []
        fits = upload(srv, "fits", wav_bytes(1.2))
        assert fits.status_code == 200, fits.text
        assert on_disk(small_disk) == ["fits.safetensors"]
        assert httpx.get(srv.http_url + "/health").status_code == 200
    finally:
        srv.stop()


async def test_a_stored_claimed_type_reads_back_as_unknown(voices_dir: Path) -> None:
    """Voices stored before types were detected hold the client's string; it is never listed again."""
    store = VoiceStore(voices_dir, max_voices=5, max_upload_bytes=2**20)
    record = await store.add(name="old", sample=wav_bytes(1.5), consent="yes", ref_text=None,
                             speaker_description=None, reserved=())
    header = {**record.header(), "mime_type": "text/html<script>alert(1)</script>"}
    path = voices_dir / "old.safetensors"
    with safe_open(str(path), framework="numpy") as f:
        audio = f.get_tensor("audio")
    path.write_bytes(safetensors_bytes({"audio": audio}, metadata=header))
    restored = VoiceStore(voices_dir, max_voices=5, max_upload_bytes=2**20)
    await restored.restore()
    assert [r.mime_type for r in restored.records()] == ["application/octet-stream"]
