"""Importing a vllm-omni voice directory at start (`--import-vllm-omni-voices`), on the real server with the
embedded engine (which cannot clone: imported voices are listed and refused clearly; `test_omni_engine.py`
clones with them). The directories are written as vllm-omni's server writes them (`tests/vllm_omni_voices`).
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import soundfile as sf
import websockets
from safetensors import safe_open
from voicewire.realtime import cli
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.vllm_omni_voices import tone, write_audio_voice, write_embedding_voice
from tests.wsclient import recv_until, send

VOICES = "/v1/audio/voices"
T0 = 1_790_000_000


def settings_for(root: Path) -> Settings:
    return Settings(voices_dir=root / "voices", import_vllm_omni_voices=root / "omni", engine_isolation="thread",
                    max_voices=8)


@pytest.fixture
def started() -> Iterator[list[ServerThread]]:
    """Servers a test starts (stopped at its end, also when it fails)."""
    servers: list[ServerThread] = []
    yield servers
    for server in servers:
        server.stop()


def start(started: list[ServerThread], settings: Settings) -> ServerThread:
    server = ServerThread(settings)
    started.append(server)
    return server


def restart(started: list[ServerThread], settings: Settings) -> ServerThread:
    started.pop().stop()
    return start(started, settings)


def uploaded(server: ServerThread) -> list[dict[str, object]]:
    voices: list[dict[str, object]] = httpx.get(server.http_url + VOICES).json()["uploaded_voices"]
    return voices


def stamps(directory: Path) -> dict[str, int]:
    """File name -> mtime_ns of every file in `directory`."""
    return {p.name: p.stat().st_mtime_ns for p in sorted(directory.iterdir())}


def summary(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vllm-omni voices from")]
    assert len(lines) == 1, lines
    return lines[0].split(": ", 1)[1]


def test_imported_voices_keep_their_facts_and_a_restart_changes_nothing(
        tmp_path: Path, started: list[ServerThread], caplog: pytest.LogCaptureFixture) -> None:
    omni = tmp_path / "omni"
    write_audio_voice(omni, "Alice", tone(1.5, 24000), 24000, created_at=T0, consent="consent-a",
                      ref_text="Hello, I am Alice.", speaker_description="warm", file_size=72044)
    write_audio_voice(omni, "stereo_bob", tone(2.0, 44100, channels=2), 44100, created_at=T0 + 5,
                      filename="bob.flac", mime_type="audio/flac", file_size=5000)
    write_audio_voice(omni, "hires", tone(1.2, 96000), 96000, created_at=T0 + 9, mime_type="audio/x-wav")
    before = stamps(omni)
    caplog.set_level(logging.INFO, "voicewire")
    settings = settings_for(tmp_path)
    server = start(started, settings)
    expected = [
        {"name": "Alice", "consent": "consent-a", "created_at": T0, "file_size": 72044, "mime_type": "audio/wav",
         "sample_rate": 24000, "duration_s": 1.5, "ref_text": "Hello, I am Alice.", "speaker_description": "warm"},
        {"name": "hires", "consent": "consent-1", "created_at": T0 + 9, "file_size": 1234,
         "mime_type": "audio/wav", "sample_rate": 48000, "duration_s": 1.2},
        {"name": "stereo_bob", "consent": "consent-1", "created_at": T0 + 5, "file_size": 5000,
         "mime_type": "audio/flac", "sample_rate": 44100, "duration_s": 2.0},
    ]
    assert uploaded(server) == expected
    assert summary(caplog) == "3 imported, 0 updated, 0 already imported, 0 skipped"
    voices = tmp_path / "voices"
    assert sorted(stamps(voices)) == ["Alice.safetensors", "hires.safetensors", "stereo_bob.safetensors"]
    with safe_open(str(voices / "stereo_bob.safetensors"), framework="numpy") as f:
        assert f.metadata()["imported_from"] == f"stereo_bob_consent-1_{T0 + 5}.safetensors"
        assert f.get_tensor("audio").shape == (88200,)  # the two channels mixed down to one
    assert stamps(omni) == before  # the source is only read

    stored = stamps(voices)
    caplog.clear()
    server = restart(started, settings)
    assert uploaded(server) == expected
    assert summary(caplog) == "0 imported, 0 updated, 3 already imported, 0 skipped"
    assert stamps(voices) == stored  # no duplicate, nothing rewritten


def test_names_match_case_insensitively_and_the_embedded_engine_refuses_to_clone_clearly(
        tmp_path: Path, started: list[ServerThread]) -> None:
    write_audio_voice(tmp_path / "omni", "Alice", tone(1.5, 24000), 24000, created_at=T0, ref_text="Hi.")
    server = start(started, settings_for(tmp_path))
    response = httpx.post(server.http_url + "/v1/audio/speech", json={"input": "Hi.", "voice": "ALICE"}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "voice"
    assert "is an uploaded voice, and engine hibari cannot clone voices (engines that can: omni)" in error["message"]

    async def over_websocket() -> dict[str, object]:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, {"type": "session.config", "voice": "alice"})
            return (await recv_until(ws, "error")).of("error")[0]

    refused = asyncio.run(over_websocket())
    assert refused["param"] == "voice" and "engine hibari cannot clone voices" in str(refused["message"])
    assert httpx.delete(server.http_url + VOICES + "/aLiCe").status_code == 200
    assert uploaded(server) == []


def test_files_that_cannot_be_imported_are_skipped_each_with_its_reason(
        tmp_path: Path, started: list[ServerThread], caplog: pytest.LogCaptureFixture) -> None:
    omni = tmp_path / "omni"
    good = write_audio_voice(omni, "carol", tone(1.5, 16000), 16000, created_at=T0 + 50)
    newest = write_audio_voice(omni, "Dave", tone(1.5, 16000), 16000, created_at=T0 + 60, ref_text="Newest.")
    reasons = {
        (omni / "broken_c_1.safetensors"): "not a readable safetensors file",
        write_embedding_voice(omni, "Emb", [0.1] * 16, created_at=T0 + 1): "is a speaker embedding",
        write_audio_voice(omni, "short", tone(0.5, 24000), 24000, created_at=T0 + 2): "holds 0.50 s of audio",
        write_audio_voice(omni, "bat", tone(1.5, 1000), 400_000, created_at=T0 + 3):
            "a sample rate of 400000 Hz is not supported",
        write_audio_voice(omni, "two words", tone(1.5, 24000), 24000, created_at=T0 + 4): "invalid voice name",
        write_audio_voice(omni, "Alloy", tone(1.5, 24000), 24000, created_at=T0 + 5): "is a built-in voice or alias",
        write_audio_voice(omni, "dave", tone(1.5, 24000), 24000, created_at=T0 + 6): "superseded by the newer file",
        write_audio_voice(omni, "silent", tone(1.5, 24000) * float("nan"), 24000, created_at=T0 + 7):
            "non-finite samples",
    }
    (omni / "broken_c_1.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    (omni / "notes.txt").write_text("not a voice file: ignored, as vllm-omni ignores it")
    caplog.set_level(logging.INFO, "voicewire")
    server = start(started, settings_for(tmp_path))
    assert [(v["name"], v.get("ref_text")) for v in uploaded(server)] == [("Dave", "Newest."), ("carol", None)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for path, reason in reasons.items():
        said = [w for w in warnings if w.startswith(f"vllm-omni voice file {path} not imported: ")]
        assert len(said) == 1 and reason in said[0], (path, said)
    assert not any(str(good) in w or str(newest) in w for w in warnings)
    assert summary(caplog) == "2 imported, 0 updated, 0 already imported, 8 skipped"
    assert sorted(p.name for p in (tmp_path / "voices").iterdir()) == ["Dave.safetensors", "carol.safetensors"]


def test_a_voicewire_voice_is_never_overwritten_and_a_newer_vllm_omni_file_updates_its_import(
        tmp_path: Path, started: list[ServerThread], caplog: pytest.LogCaptureFixture) -> None:
    omni = tmp_path / "omni"
    first = write_audio_voice(omni, "Alice", tone(1.5, 24000), 24000, created_at=T0, ref_text="First take.")
    settings = settings_for(tmp_path)
    server = start(started, settings)
    own = httpx.post(server.http_url + VOICES, files={"audio_sample": ("s.wav", wav(2.0), "audio/wav")},
                     data={"name": "erin", "consent": "mine", "ref_text": "Uploaded to voicewire."}, timeout=60)
    assert own.status_code == 200, own.text
    # vllm-omni re-uploaded Alice under another case (its upload deletes the older file) and got an `ERIN`.
    first.unlink()
    write_audio_voice(omni, "alice", tone(2.5, 24000), 24000, created_at=T0 + 100, ref_text="Second take.")
    clash = write_audio_voice(omni, "ERIN", tone(1.5, 24000), 24000, created_at=T0 + 101)
    caplog.set_level(logging.INFO, "voicewire")
    server = restart(started, settings)
    listed = {v["name"]: (v["created_at"], v["ref_text"], v["duration_s"]) for v in uploaded(server)}
    assert listed == {"alice": (T0 + 100, "Second take.", 2.5),
                      "erin": (own.json()["voice"]["created_at"], "Uploaded to voicewire.", 2.0)}
    assert summary(caplog) == "0 imported, 1 updated, 0 already imported, 1 skipped"
    assert any(r.getMessage().startswith(f"vllm-omni voice file {clash} not imported: a voice named 'erin' was "
                                         "uploaded to voicewire; it is kept") for r in caplog.records)
    assert sorted(p.name for p in (tmp_path / "voices").iterdir()) == ["alice.safetensors", "erin.safetensors"]


def wav(seconds: float) -> bytes:
    out = io.BytesIO()
    sf.write(out, tone(seconds, 16000), 16000, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.mark.parametrize("case", ["missing", "a file", "the voices dir"])
def test_a_bad_import_directory_is_a_clear_startup_error(tmp_path: Path, case: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    source = {"missing": tmp_path / "nowhere", "a file": tmp_path / "voices.tar", "the voices dir": voices}[case]
    if case == "a file":
        source.write_bytes(b"")
    assert cli.main(["serve", "--no-auth", "--voices-dir", str(voices), "--import-vllm-omni-voices", str(source)]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"voicewire: --import-vllm-omni-voices {source}: ")
    assert {"missing": "no such directory", "a file": "not a directory",
            "the voices dir": "voicewire's own voices directory"}[case] in said


def test_the_import_directory_may_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VOICEWIRE_IMPORT_VLLM_OMNI_VOICES", str(tmp_path / "absent"))
    assert cli.main(["serve", "--no-auth", "--voices-dir", str(tmp_path / "voices")]) == 2
    assert f"--import-vllm-omni-voices {tmp_path / 'absent'}: no such directory" in capsys.readouterr().err
