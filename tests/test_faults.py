"""Engine faults hurt only the unit they hit: the session and other sessions carry on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import websockets
from voicewire.adapters.hibari import HibariEngine
from voicewire.realtime.settings import Settings

from tests.faults import FaultInjectingEngine
from tests.server import ServerThread
from tests.wsclient import Received, configure, recv_until, send, utter

STREAM = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True}


@pytest.fixture(scope="module")
def faulty() -> Iterator[ServerThread]:
    srv = ServerThread(Settings(unit_timeout_s=1.0), engine=FaultInjectingEngine(HibariEngine()))
    yield srv
    srv.stop()


async def test_a_unit_that_fails_mid_audio_reports_partial_audio_and_the_session_carries_on(
        faulty: ServerThread) -> None:
    async with websockets.connect(faulty.ws_url) as ws:
        await configure(ws, **STREAM)
        await send(ws, {"type": "input.text", "text": "Before the fault. This one [raise] breaks. After it."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
        assert got.types().count("audio.start") == 3 and got.types().count("audio.done") == 3
        error = got.of("error")[0]
        assert error["code"] == "generation_failed" and not error["fatal"]
        assert error["message"].startswith("Generation failed for utterance 0, sentence 1: injected engine fault")
        assert error["partial_audio"] is True and error["action"] == "discard"
        assert [d["error"] for d in got.of("audio.done")] == [False, True, False]
        kinds = got.types()
        assert kinds.index("error") < [i for i, k in enumerate(kinds) if k == "audio.done"][1]
        await send(ws, {"type": "input.text", "text": "[raise-first] No audio at all. Then fine."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
        error = got.of("error")[0]
        assert "partial_audio" not in error and [d["error"] for d in got.of("audio.done")] == [True, False]


async def test_a_hung_unit_is_cancelled_at_its_deadline_with_a_clear_error(faulty: ServerThread) -> None:
    engine = faulty.ctx.engine
    assert isinstance(engine, FaultInjectingEngine)
    before = engine.hung_cancelled
    async with websockets.connect(faulty.ws_url) as ws:
        await configure(ws, **STREAM)
        await send(ws, {"type": "input.text", "text": "This [hang] never ends. But this does."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    error = got.of("error")[0]
    assert error["code"] == "unit_timeout" and "timed out after 1 s" in error["message"]
    assert [d["error"] for d in got.of("audio.done")] == [True, False]
    assert engine.hung_cancelled == before + 1, "the engine request was stopped"


async def test_faults_in_one_session_leave_another_untouched(faulty: ServerThread) -> None:
    async def session(text: str) -> Received:
        async with websockets.connect(faulty.ws_url) as ws:
            await configure(ws, **STREAM)
            return await utter(ws, text)

    victim, bystander = await asyncio.gather(session("[raise] Broken. [raise] Broken again. [hang] Stuck."),
                                             session("I am fine. So is this sentence. And this one."))
    assert [d["error"] for d in victim.of("audio.done")] == [True, True, True]
    assert not bystander.of("error") and [d["error"] for d in bystander.of("audio.done")] == [False, False, False]


async def test_rest_engine_failures_are_reported_in_openai_shape(faulty: ServerThread) -> None:
    import aiohttp

    url = f"{faulty.http_url}/v1/audio/speech"
    async with aiohttp.ClientSession() as http:
        # Before any audio: a clean 500 in OpenAI's error shape.
        async with http.post(url, json={"input": "[raise-first] Nothing comes out.", "voice": "alloy",
                                        "response_format": "wav", "stream": False}) as resp:
            body = await resp.json()
        assert resp.status == 500 and body["error"]["code"] == "generation_failed"
        assert body["error"]["type"] == "server_error"
        # After audio went out as SSE: a speech.audio.error event ends the stream.
        async with http.post(url, json={"input": "Fine first. Then [raise] broken.", "voice": "alloy",
                                        "stream_format": "sse"}) as resp:
            events = [line[len("event: "):] for line in (await resp.text()).splitlines() if line.startswith("event:")]
        assert resp.status == 200 and "speech.audio.delta" in events and events[-1] == "speech.audio.error"
        assert "speech.audio.done" not in events
        # After raw audio went out: the body is cut short, so the client can tell it is incomplete.
        async with http.post(url, json={"input": "Fine first. Then [raise] broken.", "voice": "alloy",
                                        "response_format": "pcm"}) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        # The server is fine afterwards.
        async with http.post(url, json={"input": "All good now.", "voice": "alloy", "response_format": "pcm"}) as resp:
            assert resp.status == 200 and len(await resp.read()) > 24000


async def test_rest_reports_a_unit_timeout_with_its_own_code(faulty: ServerThread) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{faulty.http_url}/v1/audio/speech", json={
                "input": "[hang] Never done.", "voice": "alloy", "response_format": "wav", "stream": False}) as resp:
            body = await resp.json()
    assert resp.status == 500 and body["error"]["code"] == "unit_timeout"
    assert "timed out after 1 s" in body["error"]["message"]
