"""Uploaded voices end to end: upload, list, use, delete, survive a restart, refuse bad uploads cleanly."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from voicewire.protocol.encoders import make_encoder
from voicewire.realtime.settings import Settings
from voicewire.realtime.voices import VoiceStore

from tests.rest_audio import pcm16, tone
from tests.server import ServerThread

VOICES = "/v1/audio/voices"
UPLOAD_CAP = 1_000_000


def wav_bytes(seconds: float, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, tone(seconds, rate), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def aac_bytes(seconds: float) -> bytes:
    encoder = make_encoder("aac", 24000, streaming=True)
    return encoder.encode(pcm16(tone(seconds))) + encoder.finish()


def settings_for(directory: Path) -> Settings:
    return Settings(voices_dir=directory, max_voices=3, max_voice_upload_bytes=UPLOAD_CAP)


@pytest.fixture
def voices_dir(tmp_path: Path) -> Path:
    return tmp_path / "voices"


@pytest.fixture
def voice_server(voices_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(settings_for(voices_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def refusing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    """One server and its (empty) voices directory, shared by the tests of uploads that must be refused:
    each of them checks that the directory is still empty, so none can hide behind another's leftovers."""
    directory = tmp_path_factory.mktemp("refusing") / "voices"
    srv = ServerThread(settings_for(directory))
    yield srv, directory
    srv.stop()


def upload(server: ServerThread, name: str, sample: bytes, *, consent: str = "consent-42",
           mime: str = "audio/wav", **extra: str) -> httpx.Response:
    return httpx.post(server.http_url + VOICES, files={"audio_sample": ("sample", sample, mime)},
                      data={"name": name, "consent": consent, **extra}, timeout=60)


def on_disk(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_upload_list_use_delete_and_restart(voices_dir: Path) -> None:
    voice_server = ServerThread(settings_for(voices_dir))
    try:
        use_then_stop(voice_server, voices_dir)
    except BaseException:
        voice_server.stop()
        raise
    restarted = ServerThread(settings_for(voices_dir))
    try:
        listing = httpx.get(restarted.http_url + VOICES).json()
        assert [v["name"] for v in listing["uploaded_voices"]] == ["narrator_1"]
        assert listing["uploaded_voices"][0]["ref_text"] == "A calm tone."
        assert httpx.delete(restarted.http_url + VOICES + "/narrator_1").json()["success"] is True
        assert on_disk(voices_dir) == []
        again = httpx.delete(restarted.http_url + VOICES + "/narrator_1")
        assert again.status_code == 404 and again.json()["error"]["param"] == "name"
        assert httpx.get(restarted.http_url + VOICES).json()["uploaded_voices"] == []
    finally:
        restarted.stop()


def use_then_stop(voice_server: ServerThread, voices_dir: Path) -> None:
    """Upload, list and try to speak with a voice, then stop the server."""
    response = upload(voice_server, "narrator_1", wav_bytes(2.0), ref_text="A calm tone.",
                      speaker_description="a steady hum")
    assert response.status_code == 200, response.text
    voice = response.json()["voice"]
    assert (voice["name"], voice["consent"], voice["ref_text"], voice["speaker_description"]) == (
        "narrator_1", "consent-42", "A calm tone.", "a steady hum")
    assert voice["duration_s"] == pytest.approx(2.0) and voice["sample_rate"] == 16000
    assert on_disk(voices_dir) == ["narrator_1.safetensors"]

    listing = httpx.get(voice_server.http_url + VOICES).json()
    assert "narrator_1" in listing["voices"] and "alloy" in listing["voices"]
    assert [v["name"] for v in listing["uploaded_voices"]] == ["narrator_1"]

    with openai.OpenAI(base_url=f"{voice_server.http_url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.audio.speech.create(model="tts-1", voice="narrator_1", input="Hello.")
    assert caught.value.param == "voice"
    assert "cannot clone" in caught.value.message and "engines that can: omni" in caught.value.message

    voice_server.stop()


def test_the_stored_file_holds_the_audio_and_all_metadata(voices_dir: Path) -> None:
    srv = ServerThread(settings_for(voices_dir))
    try:
        assert upload(srv, "aac_voice", aac_bytes(1.5), mime="audio/aac").status_code == 200
    finally:
        srv.stop()
    from safetensors import safe_open

    with safe_open(str(voices_dir / "aac_voice.safetensors"), framework="numpy") as f:
        meta = f.metadata()
        audio = f.get_tensor("audio")
    assert meta["name"] == "aac_voice" and meta["consent"] == "consent-42" and meta["mime_type"] == "audio/aac"
    assert audio.dtype == np.float32 and len(audio) / int(meta["sample_rate"]) == pytest.approx(1.5, abs=0.1)


MALICIOUS_NAMES = ["../evil", "..", "a/b", "a\\b", ".hidden", "/etc/passwd", "voice.safetensors", "x" * 65,
                   "two words", "nul\x00byte", "", "-dash-first"]


@pytest.mark.parametrize("name", MALICIOUS_NAMES)
def test_a_bad_name_is_refused_and_leaves_nothing(refusing_server: tuple[ServerThread, Path], name: str) -> None:
    voice_server, voices_dir = refusing_server
    response = upload(voice_server, name, wav_bytes(2.0))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "name"
    assert on_disk(voices_dir) == []
    assert not (voices_dir.parent / "evil.safetensors").exists()


@pytest.mark.parametrize(("case", "sample", "status", "code"), [
    ("over the size cap", wav_bytes(40.0, 16000)[: UPLOAD_CAP + 10], 413, "upload_too_large"),
    ("not audio", b"this is a text file, not audio\n" * 200, 400, "invalid_audio"),
    ("too short", wav_bytes(0.5), 400, "invalid_audio_duration"),
    ("too long", wav_bytes(31.0, 8000), 400, "invalid_audio_duration"),
    ("empty", b"", 400, "invalid_audio"),
])
def test_a_bad_sample_is_refused_and_leaves_nothing(refusing_server: tuple[ServerThread, Path], case: str,
                                                    sample: bytes, status: int, code: str) -> None:
    voice_server, voices_dir = refusing_server
    response = upload(voice_server, "fine_name", sample)
    assert response.status_code == status, case
    assert response.json()["error"]["param"] == "audio_sample"
    assert response.json()["error"]["code"] == code
    assert on_disk(voices_dir) == []
    assert httpx.get(voice_server.http_url + VOICES).json()["uploaded_voices"] == []


def test_consent_and_a_free_name_are_required(refusing_server: tuple[ServerThread, Path]) -> None:
    voice_server, voices_dir = refusing_server
    no_consent = upload(voice_server, "fine_name", wav_bytes(2.0), consent=" ")
    assert no_consent.status_code == 400 and no_consent.json()["error"]["param"] == "consent"
    alias = upload(voice_server, "Alloy", wav_bytes(2.0))
    assert alias.status_code == 400 and alias.json()["error"]["code"] == "voice_name_taken"
    missing = httpx.post(voice_server.http_url + VOICES, files={"name": (None, "x"), "consent": (None, "y")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "audio_sample"
    assert on_disk(voices_dir) == []


def test_the_number_of_voices_is_capped(voice_server: ServerThread, voices_dir: Path) -> None:
    for index in range(3):
        assert upload(voice_server, f"v{index}", wav_bytes(1.2)).status_code == 200
    assert upload(voice_server, "v1", wav_bytes(1.5)).status_code == 200  # replacing one is fine
    refused = upload(voice_server, "v3", wav_bytes(1.2))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "too_many_voices"
    assert on_disk(voices_dir) == ["v0.safetensors", "v1.safetensors", "v2.safetensors"]


async def test_restore_drops_interrupted_uploads_and_unreadable_files(voices_dir: Path) -> None:
    store = VoiceStore(voices_dir, max_voices=5, max_upload_bytes=UPLOAD_CAP)
    await store.add(name="kept", sample=wav_bytes(1.5), consent="yes", ref_text=None,
                    speaker_description=None, reserved=())
    (voices_dir / ".crashed.x1y2.tmp").write_bytes(b"half a voice")
    (voices_dir / "broken.safetensors").write_bytes(b"\x00" * 64)
    restored = VoiceStore(voices_dir, max_voices=5, max_upload_bytes=UPLOAD_CAP)
    await restored.restore()
    assert [r.name for r in restored.records()] == ["kept"]
    assert "kept" in restored and "broken" not in restored
    assert not (voices_dir / ".crashed.x1y2.tmp").exists()
    audio, rate = restored.load_audio("kept")
    assert rate == 16000 and len(audio) == 24000


async def test_created_at_strictly_increases_even_within_a_second(voices_dir: Path) -> None:
    store = VoiceStore(voices_dir, max_voices=5, max_upload_bytes=UPLOAD_CAP)
    stamps = []
    for name in ("one", "two", "one"):  # the third replaces the first
        record = await store.add(name=name, sample=wav_bytes(1.2), consent="yes", ref_text=None,
                                 speaker_description=None, reserved=())
        stamps.append(record.created_at)
    assert stamps[0] < stamps[1] < stamps[2]
    stored = store.get("one")
    assert stored is not None and stored.created_at == stamps[2]


def speak_with(server: ServerThread, voice: str) -> httpx.Response:
    return httpx.post(server.http_url + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": voice},
                      timeout=60)


def test_servers_sharing_a_directory_see_each_others_uploads_replacements_and_deletes(voices_dir: Path) -> None:
    first, second = ServerThread(settings_for(voices_dir)), ServerThread(settings_for(voices_dir))
    try:
        assert upload(first, "shared_1", wav_bytes(1.5), ref_text="First take.").status_code == 200
        # Known at once on the other server: listed, and resolved as an uploaded voice (this build's engines
        # cannot clone, so speaking with it is refused for that reason, not as an unknown voice).
        listed = httpx.get(second.http_url + VOICES).json()["uploaded_voices"]
        assert [(v["name"], v["ref_text"]) for v in listed] == [("shared_1", "First take.")]
        refused = speak_with(second, "shared_1")
        assert refused.status_code == 400 and "is an uploaded voice" in refused.json()["error"]["message"]

        assert upload(second, "shared_1", wav_bytes(2.0), ref_text="Second take.").status_code == 200
        listed = httpx.get(first.http_url + VOICES).json()["uploaded_voices"]
        assert [(v["name"], v["ref_text"], v["duration_s"]) for v in listed] == [("shared_1", "Second take.", 2.0)]

        for index in range(2):
            assert upload(first, f"more_{index}", wav_bytes(1.2)).status_code == 200
        full = upload(second, "one_too_many", wav_bytes(1.2))  # the cap counts the directory, not one server
        assert full.status_code == 400 and full.json()["error"]["code"] == "too_many_voices"

        assert httpx.delete(second.http_url + VOICES + "/shared_1").status_code == 200
        assert [v["name"] for v in httpx.get(first.http_url + VOICES).json()["uploaded_voices"]] == [
            "more_0", "more_1"]
        gone = speak_with(first, "shared_1")
        assert gone.status_code in (400, 404) and gone.json()["error"]["code"] == "voice_not_found"
        assert httpx.delete(first.http_url + VOICES + "/shared_1").status_code == 404
        assert on_disk(voices_dir) == ["more_0.safetensors", "more_1.safetensors"]
    finally:
        first.stop()
        second.stop()


async def test_names_match_case_insensitively_as_vllm_omni_does(voices_dir: Path) -> None:
    store = VoiceStore(voices_dir, max_voices=1, max_upload_bytes=UPLOAD_CAP)
    await store.add(name="Narrator", sample=wav_bytes(1.5), consent="yes", ref_text="First.",
                    speaker_description=None, reserved=())
    found = store.get("NARRATOR")
    assert found is not None and found.name == "Narrator" and "narrator" in store
    assert len(store.load_audio("nArRaToR")[0]) == 24000
    # An upload in another case replaces the voice (the cap of one is not hit) and takes the new spelling.
    await store.add(name="narrator", sample=wav_bytes(2.0), consent="yes", ref_text="Second.",
                    speaker_description=None, reserved=())
    assert on_disk(voices_dir) == ["narrator.safetensors"]
    replaced = store.get("Narrator")
    assert replaced is not None and (replaced.name, replaced.ref_text) == ("narrator", "Second.")
    await store.remove("NARRATOR")
    assert on_disk(voices_dir) == [] and store.get("narrator") is None
