"""The Python client (`voicewire-client`, clients/python) and its CLI against a real server on loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from voicewire.protocol.audio import float_to_alaw, float_to_mulaw
from voicewire_client import (
    AudioCancelled,
    AudioData,
    AudioStart,
    ConnectError,
    ServerError,
    SessionDone,
    UnitDecoder,
    UnknownEvent,
    connect,
    decode_event,
    parse_event,
    speak,
    stream,
)

from tests.rest_audio import decode
from tests.server import API_KEY, ServerThread, free_port

TEXT = "Hello from the Python client. It writes a wave file, and the file has the right length."


def wav_seconds(path: Path) -> float:
    with wave.open(str(path)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.getnframes() / w.getframerate()


def reported_seconds(stats_line: str) -> float:
    """The audio length in the CLI's `--stats` line: `TTFA 40 ms (server 30 ms); 3.88 s of audio in 2 units`."""
    return float(stats_line.split("; ")[1].split(" s ")[0])


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "voicewire_client", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


async def test_speak_writes_a_wav_with_the_duration_the_server_reports(server: ServerThread, tmp_path: Path) -> None:
    async with connect(server.ws_url) as session:
        updated = await session.configure(word_timestamps=True)
        result = await speak(session, TEXT)
    assert updated.engine.name == "hibari" and updated.config["response_format"] == "pcm"
    assert result.done is not None and result.done.total_sentences == 2
    out = tmp_path / "hello.wav"
    result.audio.write_wav(out)
    assert wav_seconds(out) == pytest.approx(result.done.audio_ms / 1000, abs=0.001)
    assert wav_seconds(out) > 2.0
    assert np.sqrt(np.mean(result.audio.to_float32() ** 2)) > 0.01
    assert [u.sentence_text for u in result.units] == ["Hello from the Python client.",
                                                       "It writes a wave file, and the file has the right length."]
    assert [w.word for w in result.words][:3] == ["Hello", "from", "the"]
    assert all(TEXT[w.char_start:w.char_end] == w.word for w in result.words)
    assert result.first_audio_s is not None


async def test_an_async_token_stream_is_spoken_as_it_arrives(server: ServerThread) -> None:
    first_unit_seen = asyncio.Event()

    async def llm() -> AsyncIterator[str]:
        # "T" is the lookahead that lets the server commit sentence one; the rest waits for its audio.
        sentence_one, sentence_two = "The first sentence arrives early. T", "he second waits for the first audio."
        for i in range(0, len(sentence_one), 3):
            yield sentence_one[i:i + 3]
        await asyncio.wait_for(first_unit_seen.wait(), 60)
        for i in range(0, len(sentence_two), 3):
            yield sentence_two[i:i + 3]

    async with connect(server.ws_url) as session:
        await session.configure(word_timestamps=True)
        events = []
        async for event in stream(session, llm()):
            events.append(event)
            if isinstance(event, AudioData):
                first_unit_seen.set()
    starts = [e for e in events if isinstance(e, AudioStart)]
    assert [s.sentence_text for s in starts] == ["The first sentence arrives early.",
                                                 "The second waits for the first audio."]
    assert isinstance(events[-1], SessionDone) and events[-1].total_sentences == 2


async def test_cancel_mid_utterance_stops_its_audio_and_the_next_utterance_plays(server: ServerThread) -> None:
    long_text = " ".join(f"Sentence number {n} of an answer the listener interrupts." for n in range(12))
    async with connect(server.ws_url) as session:
        await session.configure()
        await session.send_text(long_text)
        await session.done()
        async for event in session:
            if isinstance(event, AudioData):
                break
        await session.cancel()
        after: list[object] = []
        async for event in session:
            after.append(event)
            if isinstance(event, AudioCancelled):
                break
        assert not any(isinstance(e, AudioData) for e in after), "no audio of a cancelled utterance"
        assert isinstance(after[-1], AudioCancelled) and after[-1].utterance_index == 0
        result = await speak(session, "And now the next answer.")
    assert result.done is not None and result.done.utterance_index == 1
    assert result.audio.duration_s == pytest.approx(result.done.audio_ms / 1000, abs=0.001)


async def test_json_audio_frames_give_the_same_audio_and_utterance_timed_words(server: ServerThread) -> None:
    async with connect(server.ws_url) as session:
        await session.configure(audio_frames="json", word_timestamps=True)
        result = await speak(session, "One sentence here. And a second one there.")
    assert result.done is not None
    assert result.audio.duration_s == pytest.approx(result.done.audio_ms / 1000, abs=0.001)
    starts = [w.start_ms for w in result.words]
    assert starts == sorted(starts) and starts[-1] > result.done.audio_ms / 2, "second unit's words are offset"


async def test_a_refused_config_raises_the_server_error_and_the_session_stays_usable(server: ServerThread) -> None:
    async with connect(server.ws_url) as session:
        await session.configure()
        with pytest.raises(ServerError) as refused:
            await session.configure(voice="no-such-voice")
        assert refused.value.event.code == "invalid_config" and not refused.value.event.fatal
        assert "no-such-voice" in str(refused.value)
        await session.configure(voice="heart")
        result = await speak(session, "Still here.")
    assert result.audio.duration_s > 0.3


@pytest.mark.parametrize(("fmt", "encode"), [("mulaw", float_to_mulaw), ("alaw", float_to_alaw)])
def test_g711_decoding_matches_the_server_encoding(fmt: str, encode: object) -> None:
    x = (0.5 * np.sin(np.linspace(0, 40, 4000))).astype(np.float32)
    data = encode(x)  # type: ignore[operator]
    decoder = UnitDecoder(fmt)
    decoded = np.concatenate([decoder.feed(data[:1001]), decoder.feed(data[1001:])]).astype(np.float32) / 32768
    assert np.max(np.abs(decoded - x)) < 0.02


def test_cli_says_text_into_a_wav_and_prints_words_and_ttfa(server: ServerThread, tmp_path: Path) -> None:
    out = tmp_path / "say.wav"
    done = cli("say", TEXT, "-o", str(out), "--url", server.http_url, "--timestamps", "--stats", "--speed", "1.25")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[-1] == "Hello" and len(lines[0].split()) == 3
    assert lines[-1].startswith("TTFA ") and "ms" in lines[-1] and "2 units" in lines[-1]
    assert wav_seconds(out) == pytest.approx(reported_seconds(lines[-1]), abs=0.01)


def test_cli_streams_stdin_as_it_arrives(server: ServerThread, tmp_path: Path) -> None:
    """The first sentence is spoken (its words printed) while stdin is still open. ("A" is the lookahead
    the server's segmenter needs to commit sentence one.)"""
    out = tmp_path / "stdin.wav"
    proc = subprocess.Popen([sys.executable, "-m", "voicewire_client", "say", "-", "-o", str(out), "--url",
                             server.ws_url, "--timestamps", "--stats"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write("Streaming from standard input works. A")
        proc.stdin.flush()
        first_line: list[str] = []
        reader = threading.Thread(target=lambda: first_line.append(proc.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(60)
        assert first_line and first_line[0].split()[-1] == "Streaming", "words of sentence one before EOF"
        proc.stdin.write("nd this arrives later.\n")
        proc.stdin.close()
        rest = proc.stdout.read()  # the same buffered reader as the first line
        err = proc.stderr.read() if proc.stderr else ""
        proc.wait(60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    words = [first_line[0].split()[-1]] + [line.split()[-1] for line in rest.splitlines()[:-1]]
    assert words == ["Streaming", "from", "standard", "input", "works", "And", "this", "arrives", "later"]
    stats = rest.splitlines()[-1]
    assert "2 units" in stats
    assert wav_seconds(out) == pytest.approx(reported_seconds(stats), abs=0.01)


def test_refused_connection_is_a_clear_error_and_a_nonzero_exit(tmp_path: Path) -> None:
    url = f"ws://127.0.0.1:{free_port()}/v1/audio/speech/stream"

    async def attempt() -> None:
        async with connect(url):
            pass

    with pytest.raises(ConnectError, match="connection refused"):
        asyncio.run(attempt())
    done = cli("say", "Hello.", "-o", str(tmp_path / "x.wav"), "--url", url)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"voicewire-client: error: could not connect to {url}: connection refused; "
                                   "is the voicewire server running there?")
    assert not (tmp_path / "x.wav").exists()


def test_wrong_token_is_a_clear_error_and_a_nonzero_exit(keyed_server: ServerThread, tmp_path: Path) -> None:
    done = cli("say", "Hello.", "-o", str(tmp_path / "x.wav"), "--url", keyed_server.ws_url, "--token", "wrong")
    assert done.returncode == 1
    assert done.stderr.strip() == (f"voicewire-client: error: the server at {keyed_server.ws_url} rejected the "
                                   "token (HTTP 401): check --token or VOICEWIRE_TOKEN")
    assert not (tmp_path / "x.wav").exists()


def test_the_right_token_speaks(keyed_server: ServerThread, tmp_path: Path) -> None:
    out = tmp_path / "keyed.wav"
    done = cli("say", "The key works.", "-o", str(out), "--url", keyed_server.http_url, "--token", API_KEY)
    assert done.returncode == 0, done.stderr
    assert wav_seconds(out) > 0.5


def test_server_error_event_is_a_clear_error_and_a_nonzero_exit(server: ServerThread, tmp_path: Path) -> None:
    done = cli("say", "Hello.", "-o", str(tmp_path / "x.wav"), "--url", server.ws_url, "--voice", "no-such-voice")
    assert done.returncode == 1
    assert done.stderr.startswith("voicewire-client: error: server error invalid_config: Invalid session config: "
                                  "voice: unknown voice 'no-such-voice'")


@pytest.mark.parametrize("text", ["", "   ", "\n\t "])
def test_cli_refuses_empty_text_with_a_usage_error(server: ServerThread, tmp_path: Path, text: str) -> None:
    out = tmp_path / "empty.wav"
    done = cli("say", text, "-o", str(out), "--url", server.ws_url)
    assert done.returncode == 2
    assert done.stderr == "voicewire-client: error: nothing to say: the text is empty\n"
    assert not out.exists()


def test_cli_stdin_with_nothing_to_say_is_a_clear_error(server: ServerThread, tmp_path: Path) -> None:
    out = tmp_path / "blank.wav"
    done = cli("say", "-", "-o", str(out), "--url", server.ws_url, stdin="  \n \n")
    assert done.returncode == 1
    assert done.stderr == "voicewire-client: error: nothing was spoken: the text has no words to say\n"
    assert not out.exists()


@pytest.mark.parametrize(("name", "fmt", "magic"), [
    ("hi.opus", "opus", b"OggS"), ("hi.ogg", "opus", b"OggS"), ("hi.flac", "flac", b"fLaC"),
    ("hi.mp3", "mp3", None), ("hi.aac", "aac", b"\xff"),
])
def test_cli_writes_the_format_the_file_name_asks_for(server: ServerThread, tmp_path: Path, name: str, fmt: str,
                                                      magic: bytes | None) -> None:
    out = tmp_path / name
    done = cli("say", "The extension picks the format.", "-o", str(out), "--url", server.ws_url, "--stats")
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert magic is None or data.startswith(magic)
    samples, _ = decode(data, fmt)
    assert len(samples) / 24000 == pytest.approx(reported_seconds(done.stdout.splitlines()[-1]), abs=0.15)


def test_cli_writes_a_wav_file_from_any_streamed_format(server: ServerThread, tmp_path: Path) -> None:
    out = tmp_path / "mulaw.wav"
    done = cli("say", "Mu-law on the wire, a WAV on disk.", "-o", str(out), "--url", server.ws_url, "--format",
               "mulaw", "--stats")
    assert done.returncode == 0, done.stderr
    assert wav_seconds(out) == pytest.approx(reported_seconds(done.stdout.splitlines()[-1]), abs=0.01)


@pytest.mark.parametrize(("name", "fmt", "message"), [
    ("hi.wav", "opus", "-o {out} is written from decoded samples, but --format opus comes as one encoded file; "
                       "name the file .opus or pick one of alaw, mulaw, pcm, wav"),
    ("hi.mp3", "pcm", "-o {out} is for mp3 audio but --format is pcm; drop --format (the extension picks the "
                      "format) or rename the file"),
    ("hi.opus", "flac", "-o {out} is for opus audio but --format is flac; drop --format (the extension picks the "
                        "format) or rename the file"),
])
def test_cli_refuses_a_format_the_file_name_contradicts(server: ServerThread, tmp_path: Path, name: str, fmt: str,
                                                        message: str) -> None:
    out = tmp_path / name
    done = cli("say", "Hello.", "-o", str(out), "--format", fmt, "--url", server.ws_url)
    assert done.returncode == 2
    assert done.stderr == f"voicewire-client: error: {message.format(out=out)}\n"
    assert not out.exists()


def test_events_decode_by_type_tag_and_unknown_types_are_kept_whole() -> None:
    done = decode_event('{"type": "session.done", "utterance_index": 2, "total_sentences": 1, "audio_ms": 5,'
                        ' "timings": {"first_audio_ms": 12.5, "engine_ms": 3}, "new_field": 1}')
    assert isinstance(done, SessionDone) and done.first_audio_ms == 12.5 and done.engine_ms == 3.0
    assert parse_event({"type": "audio.cancelled", "utterance_index": 1, "audio_ms": 0}) == AudioCancelled(1, 0.0)
    future = {"type": "speech.flourish", "level": 3}
    assert decode_event('{"type": "speech.flourish", "level": 3}') == parse_event(future) == UnknownEvent(
        "speech.flourish", future)
    with pytest.raises(ValueError, match="audio_ms"):
        parse_event({"type": "audio.done", "utterance_index": 0, "sentence_index": 0, "total_bytes": 1,
                     "error": False})
