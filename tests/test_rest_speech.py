"""`POST /v1/audio/speech` through the official `openai` SDK against the real server and hibari engine."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from voicewire.realtime.speech import SpeechRequest, SpeechSynthesis, plan_speech

from tests.asr import transcribe, word_error_rate
from tests.rest_audio import FloatAudio, decode
from tests.server import ServerThread

TEXT = "The weather was cold and windy this morning. She opened the window to let in some fresh air."
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
                 "wav": "audio/wav", "pcm": "audio/pcm"}
SEED = {"seed": 7}


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="not-needed", max_retries=0,
                       timeout=120.0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def reference_seconds(client: openai.OpenAI) -> float:
    """Duration of TEXT as raw pcm, the yardstick every other format is held to."""
    pcm = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
                                     extra_body=SEED).content
    return len(pcm) / 2 / 24000


@pytest.mark.parametrize("fmt", list(CONTENT_TYPES))
def test_every_response_format_is_a_decodable_file_of_the_right_length(
        client: openai.OpenAI, reference_seconds: float, fmt: str) -> None:
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format=fmt,  # type: ignore[arg-type]
                                          extra_body=SEED)
    assert response.response.headers["content-type"] == CONTENT_TYPES[fmt]
    audio, rate = decode(response.content, fmt)
    assert rate == 24000
    assert 3.0 < reference_seconds < 12.0
    # Lossy codecs pad to whole frames and add encoder delay (tens of ms), never more.
    assert reference_seconds - 0.001 <= len(audio) / rate <= reference_seconds + 0.1
    assert float(np.abs(audio).max()) > 0.1


def test_default_format_is_mp3_and_the_body_is_chunked(client: openai.OpenAI) -> None:
    response = client.audio.speech.create(model="gpt-4o-mini-tts", voice="nova", input="Good morning.")
    headers = response.response.headers
    assert headers["content-type"] == "audio/mpeg"
    assert headers.get("transfer-encoding") == "chunked" and "content-length" not in headers
    assert decode(response.content, "mp3")[1] == 24000


def test_mp3_is_intelligible_to_whisper(client: openai.OpenAI) -> None:
    mp3 = client.audio.speech.create(model="tts-1-hd", voice="echo", input=TEXT, response_format="mp3",
                                     extra_body=SEED).content
    audio, rate = decode(mp3, "mp3")
    heard = transcribe(audio, rate)
    assert word_error_rate(TEXT, heard) <= 0.15, heard


def test_with_streaming_response_reads_the_audio_chunk_by_chunk(client: openai.OpenAI,
                                                                reference_seconds: float) -> None:
    chunks: list[bytes] = []
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="wav", extra_body=SEED) as response:
        assert response.headers["content-type"] == "audio/wav"
        assert response.headers["transfer-encoding"] == "chunked"
        for chunk in response.iter_bytes():
            chunks.append(chunk)
    assert len(chunks) > 1
    assert chunks[0][:4] == b"RIFF"
    audio, rate = decode(b"".join(chunks), "wav")
    assert rate == 24000 and len(audio) / rate == pytest.approx(reference_seconds, abs=0.001)


def parse_sse(text: str) -> list[dict[str, object]]:
    events = []
    for block in text.strip().split("\n\n"):
        data = [line[len("data: "):] for line in block.splitlines() if line.startswith("data: ")]
        events.append(json.loads("".join(data)))
    return events


def test_sse_sends_audio_deltas_then_done_with_usage(client: openai.OpenAI, reference_seconds: float) -> None:
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm", stream_format="sse",
            extra_body=SEED) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.read().decode())
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"}
    assert len(kinds) > 2
    pcm = b"".join(base64.b64decode(str(e["audio"])) for e in events[:-1])
    seconds = len(pcm) / 2 / 24000
    assert seconds == pytest.approx(reference_seconds, abs=0.001)
    usage = events[-1]["usage"]
    assert usage == {"input_tokens": len(TEXT), "output_tokens": math.ceil(seconds * 40),
                     "total_tokens": len(TEXT) + math.ceil(seconds * 40),
                     "input_token_details": {"text_tokens": len(TEXT), "audio_tokens": 0}}
    assert {e["response_format"] for e in events[:-1]} == {"pcm"}  # vllm-omni's delta field


def test_sse_of_mp3_carries_a_decodable_mp3(client: openai.OpenAI, reference_seconds: float) -> None:
    body = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="mp3",
                                      stream_format="sse", extra_body=SEED).content
    events = parse_sse(body.decode())
    mp3 = b"".join(base64.b64decode(str(e["audio"])) for e in events[:-1])
    audio, rate = decode(mp3, "mp3")
    assert abs(len(audio) / rate - reference_seconds) < 0.1


def test_non_streaming_response_has_usage_headers_and_word_timestamps(client: openai.OpenAI) -> None:
    raw = client.audio.speech.with_raw_response.create(
        model="tts-1", voice="alloy", input="Hello there, world.", response_format="wav",
        extra_body={"stream": False, "word_timestamps": True})
    headers = raw.headers
    audio, rate = decode(raw.content, "wav")
    seconds = len(audio) / rate
    assert int(headers["content-length"]) == len(raw.content)
    assert int(headers["x-vllm-omni-input-tokens"]) == len("Hello there, world.")
    assert int(headers["x-vllm-omni-output-tokens"]) == math.ceil(seconds * 40)
    assert int(headers["x-vllm-omni-total-tokens"]) == len("Hello there, world.") + math.ceil(seconds * 40)
    words = json.loads(headers["x-word-timestamps"])
    assert [w["word"] for w in words] == ["Hello", "there", "world"]
    assert all(0 <= w["start_ms"] < w["end_ms"] <= seconds * 1000 + 1 for w in words)
    assert [w["start_ms"] for w in words] == sorted(w["start_ms"] for w in words)


def test_flac_is_whole_with_usage_headers(client: openai.OpenAI) -> None:
    raw = client.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input="Short one.",
                                                       response_format="flac")
    assert "x-vllm-omni-output-tokens" in raw.headers
    assert raw.content.startswith(b"fLaC")


@pytest.mark.parametrize(("fmt", "requested", "file_rate"), [("pcm", 16000, 16000), ("wav", 8000, 8000),
                                                               ("opus", 22050, 24000), ("mp3", 44100, 44100)])
def test_sample_rate_sets_the_output_rate(client: openai.OpenAI, reference_seconds: float, fmt: str,
                                          requested: int, file_rate: int) -> None:
    data = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format=fmt,  # type: ignore[arg-type]
                                      extra_body={**SEED, "sample_rate": requested}).content
    audio, rate = decode(data, fmt, pcm_rate=requested)
    assert rate == file_rate
    assert abs(len(audio) / rate - reference_seconds) < 0.1


def median_pitch_hz(audio: FloatAudio, rate: int) -> float:
    """Median autocorrelation pitch over loud 40 ms frames (80-400 Hz)."""
    frame = int(0.04 * rate)
    lo, hi = rate // 400, rate // 80
    loud = 0.3 * float(np.abs(audio).max())
    pitches = []
    for start in range(0, len(audio) - frame, frame // 2):
        x = audio[start:start + frame].astype(np.float64)
        if np.abs(x).max() < loud:
            continue
        x = x - x.mean()
        ac = np.correlate(x, x, mode="full")[frame - 1:]
        lag = lo + int(np.argmax(ac[lo:hi]))
        if ac[lag] > 0.5 * ac[0]:
            pitches.append(rate / lag)
    assert len(pitches) > 10
    return float(np.median(pitches))


@pytest.mark.parametrize("speed", [0.3, 3.0])
def test_speed_beyond_the_engine_range_changes_tempo_not_pitch(client: openai.OpenAI, speed: float) -> None:
    def speak(at: float) -> FloatAudio:
        pcm = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
                                         speed=at, extra_body=SEED).content
        return decode(pcm, "pcm")[0]

    normal, fast_or_slow = speak(1.0), speak(speed)
    assert len(fast_or_slow) / len(normal) == pytest.approx(1 / speed, rel=0.2)
    assert median_pitch_hz(fast_or_slow, 24000) / median_pitch_hz(normal, 24000) == pytest.approx(1.0, rel=0.12)


def test_voice_may_be_an_object_with_an_id(client: openai.OpenAI) -> None:
    response = client.audio.speech.create(model="tts-1", voice={"id": "shimmer"}, input="Hi.",
                                          response_format="pcm")
    assert len(response.content) > 2400


def test_units_are_pipelined_at_most_the_cap_in_flight(server: ServerThread) -> None:
    """While the first unit streams, the second is already synthesizing and the third is not started."""
    text = "One small step. Two small steps. Three small steps. Four small steps."
    ctx = server.ctx
    assert ctx.facts is not None
    plan = plan_speech(SpeechRequest(input=text, response_format="pcm"), ctx.facts,
                       max_input_chars=ctx.settings.max_input_chars)
    assert len(plan.units) == 4 and ctx.settings.max_units_in_flight == 2

    async def run() -> tuple[set[str], int]:
        synthesis = SpeechSynthesis(ctx, plan, "pipelined", time.monotonic())
        alive_at_first_audio: set[str] = set()
        async for _ in synthesis.chunks():
            if not alive_at_first_audio:
                alive_at_first_audio = {t.get_name() for t in asyncio.all_tasks()
                                        if t.get_name().startswith("pipelined-") and not t.done()}
        return alive_at_first_audio, synthesis.samples

    alive, samples = server.call(run, timeout=120)
    assert "pipelined-1" in alive and "pipelined-2" not in alive and "pipelined-3" not in alive
    assert samples > 4 * 12000


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "hibari" and {"tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= set(ids)
    assert client.models.retrieve("tts-1").owned_by == "voicewire"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("whisper-1")
    assert caught.value.code == "model_not_found"


def test_batch_returns_each_item_or_its_error(server: ServerThread) -> None:
    response = httpx.post(f"{server.http_url}/v1/audio/speech/batch", timeout=120, json={
        "voice": "alloy",
        "items": [{"input": "First sentence."}, {"input": "Second.", "response_format": "mp3"},
                  {"input": "Third.", "speed": 9}, {"input": "Fourth.", "voice": "nobody"}]})
    assert response.status_code == 200
    body = response.json()
    assert (body["total"], body["succeeded"], body["failed"]) == (4, 2, 2)
    first, second, third, fourth = body["results"]
    assert first["status"] == "success" and first["media_type"] == "audio/wav"
    audio, rate = decode(base64.b64decode(first["audio_data"]), "wav")
    assert rate == 24000 and first["usage"]["output_tokens"] == math.ceil(len(audio) / rate * 40)
    assert second["media_type"] == "audio/mpeg" and decode(base64.b64decode(second["audio_data"]), "mp3")[1] == 24000
    assert third["status"] == "error" and "speed" in third["error"]
    assert fourth["status"] == "error" and "unknown voice 'nobody'" in fourth["error"]
    assert [r["index"] for r in body["results"]] == [0, 1, 2, 3]


def test_a_client_that_hangs_up_cancels_the_rest_of_its_units(server: ServerThread) -> None:
    text = " ".join(f"This is sentence number {n} of a long reading." for n in range(60))

    def scrape() -> tuple[float, float]:
        samples = {(s.name, s.labels.get("outcome")): s.value for family in text_string_to_metric_families(
            httpx.get(server.http_url + "/metrics").text) for s in family.samples}
        return (samples.get(("voicewire_units_total", "cancelled"), 0.0),
                samples[("voicewire_rest_speech_in_flight", None)])

    cancelled_before, _ = scrape()
    with httpx.stream("POST", server.http_url + "/v1/audio/speech", timeout=60,
                      json={"input": text, "response_format": "pcm"}) as response:
        assert response.status_code == 200
        assert next(response.iter_raw())
    for _ in range(200):  # the server notices at its next write; wait for it, bounded
        cancelled, in_flight = scrape()
        if cancelled > cancelled_before and in_flight == 0:
            break
        time.sleep(0.05)
    assert cancelled > cancelled_before and in_flight == 0
