"""A client written for vllm-omni's /v1/audio/speech/stream sees vllm-omni's message sequences.

Asserted message by message. voicewire adds `session.updated` after each accepted config (vllm-omni sends
nothing); vllm-omni clients ignore event types they do not know, so sequences are compared without it,
and extra fields (ours) are allowed next to vllm-omni's.
"""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import websockets

from tests.rest_audio import decode
from tests.server import ServerThread
from tests.wsclient import Received, recv_until, send, utter


def without_updates(got: Received) -> list[str]:
    return [t for t in got.types() if t != "session.updated"]


async def test_default_config_gives_one_whole_wav_per_utterance(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config"})
        for token in ("Hello", " world.", " How are", " you?"):
            await send(ws, {"type": "input.text", "text": token})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    assert without_updates(got) == ["audio.start", "<binary>", "audio.done", "session.done"]
    start, done, session_done = got.of("audio.start")[0], got.of("audio.done")[0], got.of("session.done")[0]
    assert {k: start[k] for k in ("utterance_index", "sentence_index", "sentence_text", "format")} == {
        "utterance_index": 0, "sentence_index": 0, "sentence_text": "Hello world. How are you?", "format": "wav"}
    wav = next(i for i in got.items if isinstance(i, bytes))
    assert wav.startswith(b"RIFF")
    with wave.open(io.BytesIO(wav)) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 24000
    assert {k: done[k] for k in ("utterance_index", "sentence_index", "total_bytes", "error")} == {
        "utterance_index": 0, "sentence_index": 0, "total_bytes": len(wav), "error": False}
    assert {k: session_done[k] for k in ("utterance_index", "total_sentences")} == {
        "utterance_index": 0, "total_sentences": 1}


async def test_sentence_split_one_wav_per_sentence_and_next_utterance_index(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config", "split_granularity": "sentence"})
        first = await utter(ws, "First sentence. Second sentence!")
        second = await utter(ws, "Third.")
    assert without_updates(first) == ["audio.start", "<binary>", "audio.done"] * 2 + ["session.done"]
    assert [e["sentence_text"] for e in first.of("audio.start")] == ["First sentence.", "Second sentence!"]
    assert [e["sentence_index"] for e in first.of("audio.done")] == [0, 1]
    assert first.of("session.done")[0]["total_sentences"] == 2
    assert without_updates(second) == ["audio.start", "<binary>", "audio.done", "session.done"]
    assert second.of("session.done")[0]["utterance_index"] == 1


async def test_clause_split(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config", "split_granularity": "clause"})
        got = await utter(ws, "When the rain stops, we will walk to the park.")
    assert [e["sentence_text"] for e in got.of("audio.start")] == ["When the rain stops,", "we will walk to the park."]


async def test_stream_audio_pcm_gives_raw_s16le_chunks(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config", "stream_audio": True, "response_format": "pcm"})
        await send(ws, {"type": "input.text", "text": "Streaming raw samples now."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    kinds = without_updates(got)
    assert kinds[0] == "audio.start" and kinds[-2:] == ["audio.done", "session.done"]
    assert set(kinds[1:-2]) == {"<binary>"}
    start = got.of("audio.start")[0]
    assert start["format"] == "pcm" and start["sample_rate"] == 24000 and start["channels"] == 1
    audio = b"".join(i for i in got.items if isinstance(i, bytes))
    assert not audio.startswith(b"RIFF") and len(audio) % 2 == 0
    assert got.of("audio.done")[0]["total_bytes"] == len(audio)


async def test_word_timestamps_ride_json_audio_chunks_with_a_trailing_timestamps_chunk(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config", "stream_audio": True, "response_format": "pcm",
                        "word_timestamps": True})
        await send(ws, {"type": "input.text", "text": "Hello world, this is timed."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    kinds = without_updates(got)
    assert "<binary>" not in kinds and "audio.words" not in kinds
    assert kinds[0] == "audio.start" and kinds[-2:] == ["audio.done", "session.done"]
    assert got.of("audio.start")[0]["word_timestamps"] is True
    chunks = got.of("audio.chunk")
    assert len(chunks) >= 2 and [c["chunk_id"] for c in chunks] == list(range(len(chunks)))
    live, trailing = chunks[:-1], chunks[-1]
    audio = b"".join(base64.b64decode(c["audio_b64"]) for c in live)
    assert all(c["timestamps"] is None for c in live)
    assert all(list(c)[:10] == ["type", "utterance_index", "sentence_index", "chunk_id", "chunk_start_ms",
                                "chunk_end_ms", "sample_rate", "channels", "audio_b64", "timestamps"]
               for c in chunks)
    duration_ms = len(audio) / 2 / 24000 * 1000
    assert live[0]["chunk_start_ms"] == 0 and abs(live[-1]["chunk_end_ms"] - duration_ms) <= 1
    assert trailing["audio_b64"] == "" and trailing["chunk_start_ms"] == 0
    assert abs(trailing["chunk_end_ms"] - duration_ms) <= 1
    words = trailing["timestamps"]
    assert [w["word"] for w in words] == ["Hello", "world", "this", "is", "timed"]
    assert all(isinstance(w["start_ms"], int) and isinstance(w["end_ms"], int) for w in words)
    ends = np.array([w["end_ms"] for w in words])
    assert np.all(np.diff(ends) > 0) and ends[-1] <= duration_ms + 1
    assert got.of("audio.done")[0]["total_bytes"] == len(audio)


async def test_empty_utterance_gives_session_done_with_no_sentences(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config"})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    assert without_updates(got) == ["session.done"]
    assert got.of("session.done")[0]["total_sentences"] == 0


async def test_errors_carry_vllm_omni_texts_and_unknown_config_fields_are_ignored(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config", "non_streaming_mode": True, "some_future_field": 1})
        await send(ws, {"type": "input.bogus"})
        error = (await recv_until(ws, "error")).of("error")[0]
        assert error["message"] == "Unknown message type: input.bogus"
        await ws.send(json.dumps({"type": "input.text", "text": ["x"]}))
        error = (await recv_until(ws, "error")).of("error")[0]
        assert error["message"] == "input.text requires a string value"


async def test_aac_is_one_whole_adts_file_per_sentence(server: ServerThread) -> None:
    """vllm-omni's example client asks for `aac` (REST has it): each sentence comes as one ADTS file that
    decodes to the unit's duration."""
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config", "response_format": "aac", "split_granularity": "sentence"})
        await send(ws, {"type": "input.text", "text": "First sentence here. And the second one!"})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    assert without_updates(got) == ["audio.start", "<binary>", "audio.done"] * 2 + ["session.done"]
    files = [i for i in got.items if isinstance(i, bytes)]
    for start, done, data in zip(got.of("audio.start"), got.of("audio.done"), files, strict=True):
        assert start["format"] == "aac" and start["sample_rate"] == 24000
        assert data[0] == 0xFF and data[1] & 0xF6 == 0xF0, "ADTS frame sync, MPEG-4, layer 0"
        assert done["total_bytes"] == len(data) and done["error"] is False
        samples, rate = decode(data, "aac")
        assert rate == 24000
        # AAC adds encoder priming and pads the last frame: within three 1024-sample frames.
        assert abs(len(samples) - done["audio_ms"] * rate / 1000) <= 3 * 1024


async def test_streaming_aac_is_refused_naming_the_streamable_formats(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config", "response_format": "aac", "stream_audio": True})
        error = (await recv_until(ws, "error")).of("error")[0]
    assert error["code"] == "invalid_config" and error["param"] == "response_format"
    assert error["message"] == ("Invalid session config: response_format: stream_audio=true needs one of alaw, "
                                "mulaw, pcm, wav; 'aac' can only be sent as one whole file per sentence")


async def test_an_unknown_format_error_lists_the_valid_formats(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, {"type": "session.config", "response_format": "aiff"})
        error = (await recv_until(ws, "error")).of("error")[0]
    assert error["code"] == "invalid_config" and error["param"] == "response_format"
    assert error["message"].endswith("; valid values: aac, alaw, flac, mp3, mulaw, opus, pcm, wav")
