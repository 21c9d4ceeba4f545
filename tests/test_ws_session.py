"""The realtime WebSocket session end to end: real server on loopback, real client, real hibari engine."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import re
import wave
import weakref

import numpy as np
import pytest
import websockets

from tests.server import ServerThread
from tests.wsclient import Received, configure, recv_until, send, stream_tokens

CONVERSATION = (
    "Hello there! Dr. Smith bought 1,000 apples for 3.14 dollars each, e.g. the red ones. "
    "Can you believe that? I certainly can't."
)


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def units_of(got: Received) -> list[dict[str, object]]:
    """Group a binary-framed stream into units: start event, audio bytes, words, done event."""
    units: list[dict[str, object]] = []
    current: dict[str, object] | None = None
    for item in got.items:
        if isinstance(item, bytes):
            assert current is not None, "audio outside audio.start/audio.done"
            current["audio"] = bytes(current["audio"]) + item  # type: ignore[arg-type]
            continue
        kind = item["type"]
        if kind == "audio.start":
            assert current is None, "audio.start before the previous audio.done"
            current = {"start": item, "audio": b"", "words": []}
        elif kind == "audio.words":
            assert current is not None
            current["words"] = [*current["words"], *item["words"]]  # type: ignore[misc]
        elif kind == "audio.done":
            assert current is not None
            current["done"] = item
            units.append(current)
            current = None
    assert current is None
    return units


async def test_streamed_conversation_gives_ordered_units_with_words(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        updated = await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True,
                                  word_timestamps=True, audio_frames="binary")
        assert updated["config"]["sample_rate"] == 24000
        await stream_tokens(ws, CONVERSATION)
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")

    assert got.types()[-1] == "session.done"
    units = units_of(got)
    texts = [u["start"]["sentence_text"] for u in units]  # type: ignore[index]
    assert texts == [
        "Hello there!",
        "Dr. Smith bought 1,000 apples for 3.14 dollars each, e.g. the red ones.",
        "Can you believe that?",
        "I certainly can't.",
    ]
    done = got.of("session.done")[0]
    assert done["total_sentences"] == 4
    offset_ms = 0.0
    last_end = 0
    for index, unit in enumerate(units):
        start, done_evt = unit["start"], unit["done"]
        assert start["sentence_index"] == index and start["sample_rate"] == 24000  # type: ignore[index]
        audio = pcm16(unit["audio"])  # type: ignore[arg-type]
        duration_ms = len(audio) / 24.0
        assert done_evt["total_bytes"] == len(unit["audio"]) and not done_evt["error"]  # type: ignore[index,arg-type]
        assert done_evt["audio_ms"] == pytest.approx(duration_ms, abs=0.1)  # type: ignore[index]
        assert duration_ms > 300 and np.sqrt(np.mean(audio**2)) > 0.01
        words = unit["words"]
        assert words, "each unit carries word timings"
        for word in words:  # type: ignore[attr-defined]
            assert CONVERSATION[word["char_start"]:word["char_end"]] == word["word"]
            assert word["start_ms"] >= last_end - 1 and word["end_ms"] >= word["start_ms"]
            assert offset_ms - 1 <= word["start_ms"] and word["end_ms"] <= offset_ms + duration_ms + 1
            last_end = word["end_ms"]
        offset_ms += duration_ms
    spoken = [w["word"] for u in units for w in u["words"]]  # type: ignore[attr-defined]
    assert spoken == re.findall(r"[\w.,'$]+[\w]", CONVERSATION) or spoken[:4] == ["Hello", "there", "Dr", "Smith"]
    assert done["audio_ms"] == pytest.approx(offset_ms, abs=1)
    assert done["timings"]["first_audio_ms"] is not None


async def test_cancel_stops_audio_and_engine_then_next_utterance_works(server: ServerThread) -> None:
    long_text = " ".join(f"This is sentence number {n} of a long answer that we will interrupt." for n in range(12))
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
        await send(ws, {"type": "input.text", "text": long_text})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "audio.start")
        frame = await ws.recv()
        assert isinstance(frame, bytes)
        got.items.append(frame)
        started_before = server.ctx.engine.stats.started  # type: ignore[attr-defined]
        await send(ws, {"type": "input.cancel"})
        after = await recv_until(ws, "audio.cancelled", into=got)
        cancelled = after.of("audio.cancelled")[0]
        assert cancelled["utterance_index"] == 0
        assert after.types()[-1] == "audio.cancelled"
        starts, dones = after.of("audio.start"), after.of("audio.done")
        assert [d["sentence_index"] for d in dones] == [s["sentence_index"] for s in starts], \
            "every unit that started is closed by its audio.done before audio.cancelled"
        assert cancelled["audio_ms"] == pytest.approx(sum(d["audio_ms"] for d in dones), abs=0.1)
        # Nothing of utterance 0 after audio.cancelled: the next thing is the next utterance's session.updated.
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
        await _wait_engine_idle(server)
        stats = server.ctx.engine.stats  # type: ignore[attr-defined]
        assert stats.started <= started_before + 2, "no new units of a cancelled utterance were started"
        assert stats.started == stats.completed + stats.cancelled
        await send(ws, {"type": "input.text", "text": "And now something else."})
        await send(ws, {"type": "input.done"})
        nxt = await recv_until(ws, "session.done")
    assert nxt.of("session.done")[0]["utterance_index"] == 1
    assert [e["utterance_index"] for e in nxt.of("audio.start")] == [1]
    assert any(isinstance(i, bytes) for i in nxt.items)


async def test_a_cancel_that_comes_after_session_done_changes_nothing(server: ServerThread) -> None:
    """Every utterance ends with exactly one of `session.done` and `audio.cancelled`. A barge-in that crosses
    `session.done` on the wire finds nothing to stop: no `audio.cancelled` is sent for the ended utterance,
    and the session goes on (the client knows from the `session.done` it receives)."""
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
        await send(ws, {"type": "input.text", "text": "Short one.", "context_id": "turn-1"})
        await send(ws, {"type": "input.done"})
        first = await recv_until(ws, "session.done")
        await send(ws, {"type": "input.cancel", "context_id": "turn-1"})
        await send(ws, {"type": "input.cancel"})
        await send(ws, {"type": "input.text", "text": "And the next.", "context_id": "turn-2"})
        await send(ws, {"type": "input.done"})
        second = await recv_until(ws, "session.done")
    assert first.of("session.done")[0]["utterance_index"] == 0
    assert "audio.cancelled" not in second.types() and "error" not in second.types()
    assert second.of("session.done")[0]["utterance_index"] == 1
    assert any(isinstance(i, bytes) for i in second.items)


async def _wait_engine_idle(server: ServerThread) -> None:
    async def idle() -> None:
        scheduler = server.ctx.scheduler
        assert scheduler is not None
        while scheduler.in_use or scheduler.queue_depth:
            await asyncio.sleep(0.01)

    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(idle(), server.loop))


async def test_disconnect_frees_engine_work(server: ServerThread) -> None:
    long_text = " ".join(f"Sentence {n} keeps the engine busy for a while longer." for n in range(20))
    stats_before = server.ctx.engine.stats  # type: ignore[attr-defined]
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
        await send(ws, {"type": "input.text", "text": long_text})
        await send(ws, {"type": "input.done"})
        await recv_until(ws, "audio.start")
    await _wait_engine_idle(server)
    stats = server.ctx.engine.stats  # type: ignore[attr-defined]
    assert stats.started - stats_before.started < 20, "units after the disconnect were never started"
    assert stats.started == stats.completed + stats.cancelled
    assert not server.ctx.sessions or all(not s.busy for s in server.ctx.sessions)  # type: ignore[attr-defined]


async def test_a_finished_session_is_freed_without_the_garbage_collector(server: ServerThread) -> None:
    """A session's objects die by reference counting when its socket closes, not in reference cycles left
    for a full collection: those pause the event loop, and every stream with it, in proportion to what
    they free (16-22 thousand objects and 10-28 ms a collection at 128 talker sessions on an H100, when a
    session's unit runner held a bound method of the session). With the collector off, the session's
    runtime is gone once the server has let go of it."""
    gc.disable()
    try:
        async with websockets.connect(server.ws_url) as ws:
            updated = await configure(ws, response_format="pcm")
            await send(ws, {"type": "input.text", "text": "Hello there."})
            await send(ws, {"type": "input.done"})
            await recv_until(ws, "session.done")
            ours = [s for s in list(server.ctx.sessions) if s.session_id == updated["session_id"]]
            assert len(ours) == 1
            runtime = weakref.ref(ours[0])
            del ours
        for _ in range(500):
            if runtime() is None:
                break
            await asyncio.sleep(0.01)
        assert runtime() is None, gc.get_referrers(runtime())
    finally:
        gc.enable()


async def test_two_sessions_get_their_own_audio_untouched_by_the_others_errors(server: ServerThread) -> None:
    async def good(text: str) -> Received:
        async with websockets.connect(server.ws_url) as ws:
            await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
            await stream_tokens(ws, text)
            await send(ws, {"type": "input.done"})
            return await recv_until(ws, "session.done")

    async def bad() -> Received:
        async with websockets.connect(server.ws_url) as ws:
            await configure(ws, split_granularity="sentence")
            got = Received()
            for frame in ("{not json", "[1, 2]", json.dumps({"type": "nope"}), json.dumps({"type": "input.text",
                                                                                            "text": 5})):
                await ws.send(frame)
                await recv_until(ws, "error", got)
            await ws.send(b"\x00\x01")
            await recv_until(ws, "error", got)
            return got

    a, b, errors = await asyncio.gather(good("The first session speaks. It has two sentences."),
                                        good("The second one says something else entirely."), bad())
    assert [e["sentence_text"] for e in a.of("audio.start")] == ["The first session speaks.", "It has two sentences."]
    assert [e["sentence_text"] for e in b.of("audio.start")] == ["The second one says something else entirely."]
    assert len(errors.of("error")) == 5 and not any(e["fatal"] for e in errors.of("error"))


async def test_config_echo_and_limits_are_published(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        updated = await configure(ws, voice="alloy", speed=1.5, sample_rate=16000, response_format="wav",
                                  task_type="CustomVoice", seed=7)
    config = updated["config"]
    assert config["voice"] == "heart" and config["speed"] == 1.5 and config["sample_rate"] == 16000
    assert config["task_type"] == "CustomVoice" and config["seed"] == 7
    limits = updated["limits"]
    for key in ("config_timeout_s", "idle_timeout_s", "max_message_bytes", "max_utterance_chars", "max_sessions"):
        assert limits[key] > 0
    assert updated["engine"]["name"] == "hibari" and updated["engine"]["sample_rate"] == 24000


async def test_whole_wav_per_unit_at_requested_rate_and_speed(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, split_granularity="sentence", sample_rate=16000, speed=3.0)
        await send(ws, {"type": "input.text", "text": "Fast speech at a lower rate. Second sentence here."})
        await send(ws, {"type": "input.done"})
        fast = await recv_until(ws, "session.done")
        await configure(ws, split_granularity="sentence", sample_rate=16000)
        await send(ws, {"type": "input.text", "text": "Fast speech at a lower rate. Second sentence here."})
        await send(ws, {"type": "input.done"})
        normal = await recv_until(ws, "session.done")
    durations = []
    for got in (fast, normal):
        frames = [i for i in got.items if isinstance(i, bytes)]
        assert len(frames) == 2, "one binary frame (a whole WAV) per unit"
        total = 0.0
        for frame in frames:
            with wave.open(io.BytesIO(frame)) as w:
                assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
                total += w.getnframes() / 16000
        durations.append(total)
    assert 0.25 < durations[0] / durations[1] < 0.45, durations


async def test_full_server_refuses_with_1013() -> None:
    from voicewire.realtime.settings import Settings

    srv = ServerThread(Settings(max_sessions=1))
    try:
        async with websockets.connect(srv.ws_url) as first:
            await configure(first)
            async with websockets.connect(srv.ws_url) as second:
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await second.recv()
                assert info.value.rcvd is not None and info.value.rcvd.code == 1013
    finally:
        srv.stop()
