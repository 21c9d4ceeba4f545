"""Hostile voice uploads: description formats that point elsewhere, decompression bombs, lying types,
oversized form parts, a full disk. Each is refused cleanly (an OpenAI-shaped error), opens no socket and
no file, stores nothing, and leaves the server serving."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.server import ServerThread, free_port
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
