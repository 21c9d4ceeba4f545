"""The Pipecat integration (`voicewire_client.pipecat`) in a real Pipecat pipeline against a real server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

pytest.importorskip("pipecat")

from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode
from pipecat.workers.runner import WorkerRunner
from voicewire_client.pipecat import VoicewireTTSService

from tests.llm_text import LONG_REPLY, REPLY, llm_tokens
from tests.proxy import Proxy
from tests.server import ServerThread

PIPELINE_RATE = 16000



@dataclass
class Sink(FrameProcessor):
    """Collects what the TTS pushes downstream (and errors pushed upstream) and lets a test wait on it."""

    frames: list[Frame] = field(default_factory=list)
    errors: list[ErrorFrame] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        self._changed = asyncio.Condition()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append(frame)
        await self.push_frame(frame, direction)
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[list[Frame]], bool], timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: predicate(self.frames))

    def of(self, kind: type[Frame]) -> list[Frame]:
        return [f for f in self.frames if isinstance(f, kind)]


class ErrorCollector(FrameProcessor):
    """First in the pipeline: catches `ErrorFrame`s pushed upstream by the TTS."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[ErrorFrame] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, ErrorFrame):
            self.errors.append(frame)
        await self.push_frame(frame, direction)


@dataclass
class Running:
    worker: PipelineWorker
    tts: VoicewireTTSService
    sink: Sink
    errors: ErrorCollector

    async def send(self, frames: Sequence[Frame]) -> None:
        for frame in frames:
            await self.worker.queue_frame(frame)


@asynccontextmanager
async def pipeline(tts: VoicewireTTSService) -> AsyncIterator[Running]:
    """tts in a real Pipecat pipeline at PIPELINE_RATE, started; ended with an EndFrame on exit."""
    errors, sink = ErrorCollector(), Sink()
    worker = PipelineWorker(Pipeline([errors, tts, sink]), cancel_on_idle_timeout=False,
                            params=PipelineParams(audio_out_sample_rate=PIPELINE_RATE))
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(_worker: PipelineWorker, _frame: Frame) -> None:
        started.set()

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    try:
        async with asyncio.timeout(60):
            await started.wait()
        yield Running(worker, tts, sink, errors)
        await worker.stop_when_done()
        async with asyncio.timeout(60):
            await run
    finally:
        if not run.done():
            await worker.cancel()
            await run


def server_count(server: ServerThread, name: str, **labels: str) -> float:
    return server.ctx.metrics.registry.get_sample_value(name, labels) or 0.0


def llm_reply(text: str) -> list[Frame]:
    return [LLMFullResponseStartFrame(), *(LLMTextFrame(t) for t in llm_tokens(text)), LLMFullResponseEndFrame()]


def spoken_words(frames: list[Frame]) -> list[TTSTextFrame]:
    return [f for f in frames if isinstance(f, TTSTextFrame) and not f.skip_tts]


@pytest.mark.parametrize("mode", [TextAggregationMode.SENTENCE, TextAggregationMode.TOKEN])
async def test_an_llm_reply_is_spoken_at_the_pipeline_rate_with_words_in_order(
        server: ServerThread, mode: TextAggregationMode) -> None:
    tts = VoicewireTTSService(url=server.ws_url, voice="heart", text_aggregation_mode=mode)
    async with pipeline(tts) as run:
        await run.send(llm_reply(REPLY))
        await run.sink.wait_for(lambda fs: any(isinstance(f, LLMFullResponseEndFrame) for f in fs))
        frames = run.sink.frames
        audio = [f for f in frames if isinstance(f, TTSAudioRawFrame)]
        assert audio and all(f.sample_rate == PIPELINE_RATE and f.num_channels == 1 for f in audio)
        seconds = sum(len(f.audio) for f in audio) / 2 / PIPELINE_RATE
        assert 2.0 < seconds < 15.0
        started, stopped = run.sink.of(TTSStartedFrame), run.sink.of(TTSStoppedFrame)
        assert len(started) == 1 and len(stopped) == 1
        context_id = started[0].context_id
        assert {f.context_id for f in audio} == {context_id}
        # audio comes between the context's start and stop
        assert frames.index(started[0]) < frames.index(audio[0]) and frames.index(audio[-1]) < frames.index(stopped[0])

        words = spoken_words(frames)
        assert " ".join(w.text for w in words).split() == REPLY.split()
        pts = [w.pts for w in words]
        assert all(p is not None for p in pts) and pts == sorted(pts) and len(set(pts)) == len(pts)
        assert not run.errors.errors


async def test_a_second_turn_and_a_speak_frame_reuse_the_one_socket(server: ServerThread) -> None:
    tts = VoicewireTTSService(url=server.ws_url, voice="heart")
    async with pipeline(tts) as run:
        session, socket = tts.session_id, tts._websocket
        assert session is not None
        await run.send(llm_reply("First answer."))
        await run.sink.wait_for(lambda fs: len([f for f in fs if isinstance(f, TTSStoppedFrame)]) == 1)
        await run.send([TTSSpeakFrame("And a spoken note.")])
        await run.send(llm_reply("Second answer."))
        await run.sink.wait_for(lambda fs: len([f for f in fs if isinstance(f, TTSStoppedFrame)]) == 3)
        assert tts.session_id == session and tts._websocket is socket
        assert " ".join(w.text for w in spoken_words(run.sink.frames)).split() == \
            "First answer. And a spoken note. Second answer.".split()
        assert not run.errors.errors


async def test_an_interruption_stops_the_audio_over_the_same_socket(server: ServerThread) -> None:
    tts = VoicewireTTSService(url=server.ws_url, voice="heart", text_aggregation_mode=TextAggregationMode.TOKEN)
    async with pipeline(tts) as run:
        session, socket = tts.session_id, tts._websocket
        await run.send(llm_reply(LONG_REPLY))
        await run.sink.wait_for(lambda fs: any(isinstance(f, TTSAudioRawFrame) for f in fs))
        sessions = server_count(server, "voicewire_sessions_total")
        cancelled = server_count(server, "voicewire_units_total", outcome="cancelled")
        await run.send([InterruptionFrame()])
        await run.sink.wait_for(lambda fs: any(isinstance(f, InterruptionFrame) for f in fs))
        cut = len(run.sink.frames)
        interrupted = run.sink.of(TTSStartedFrame)[0].context_id

        await run.send(llm_reply("Okay, stopping."))
        await run.sink.wait_for(lambda fs: any(isinstance(f, TTSStoppedFrame) for f in fs[cut:]))
        after = run.sink.frames[cut:]
        assert not [f for f in after if isinstance(f, TTSAudioRawFrame) and f.context_id == interrupted]
        assert [f for f in after if isinstance(f, TTSAudioRawFrame)]
        assert " ".join(w.text for w in spoken_words(after)).split() == ["Okay,", "stopping."]
        assert tts.session_id == session and tts._websocket is socket
        assert server_count(server, "voicewire_sessions_total") == sessions  # no reconnect
        assert server_count(server, "voicewire_units_total", outcome="cancelled") > cancelled  # input.cancel
        spoken = sum(len(f.audio) for f in run.sink.of(TTSAudioRawFrame) if f.context_id == interrupted)
        assert spoken / 2 / PIPELINE_RATE < 15.0  # far less than the whole long reply (about 30 s)
        assert not run.errors.errors


async def test_a_dropped_socket_is_replaced_and_the_next_turn_is_spoken(server: ServerThread) -> None:
    tts = VoicewireTTSService(url=server.ws_url, voice="heart", reconnect_backoff_min_wait=0.1)
    async with pipeline(tts) as run:
        dropped = tts.session_id

        async def drop() -> None:
            runtime = next(r for r in server.ctx.sessions if r.session_id == dropped)  # type: ignore[attr-defined]
            await runtime.ws.close(code=1001, message=b"going away")

        server.call(drop)
        async with asyncio.timeout(30):
            while tts.session_id in (None, dropped):
                await asyncio.sleep(0.05)
        await run.send(llm_reply("Back again."))
        await run.sink.wait_for(lambda fs: any(isinstance(f, TTSStoppedFrame) for f in fs))
        assert " ".join(w.text for w in spoken_words(run.sink.frames)).split() == ["Back", "again."]
        assert run.sink.of(TTSAudioRawFrame)


async def test_a_refused_session_config_is_reported_as_an_error(server: ServerThread) -> None:
    tts = VoicewireTTSService(url=server.ws_url, voice="no-such-voice")
    async with pipeline(tts) as run:
        async with asyncio.timeout(30):
            while not run.errors.errors:
                await asyncio.sleep(0.05)
        assert tts.session_id is None
    message = run.errors.errors[0].error
    assert "refused the session config: invalid_config: Invalid session config: voice: unknown voice" in message


async def test_a_voice_change_reconfigures_the_same_socket_before_the_next_turn(server: ServerThread) -> None:
    tts = VoicewireTTSService(url=server.ws_url, voice="heart")
    async with pipeline(tts) as run:
        session = tts.session_id
        assert tts._session is not None
        first = tts._session.updated
        await run.send([TTSUpdateSettingsFrame(delta=TTSSettings(voice="alloy"))])
        await run.send(llm_reply("A new voice speaks."))
        await run.sink.wait_for(lambda fs: any(isinstance(f, TTSStoppedFrame) for f in fs))
        assert tts.session_id == session
        again = tts._session.updated
        assert again is not None and again is not first, "session.config was sent again and answered"
        assert again.config["voice"] == "heart"  # alloy is an alias of hibari's one voice
        assert " ".join(w.text for w in spoken_words(run.sink.frames)).split() == "A new voice speaks.".split()
        assert not run.errors.errors


async def _spoken(url: str, proxy: Proxy | None = None) -> tuple[bytes, list[str], VoicewireTTSService]:
    """One LLM reply through a pipeline on `url` (the connection cut a third into its audio when a `proxy`
    is given): the audio and the words the pipeline got, and the service."""
    tts = VoicewireTTSService(url=url, voice="heart", session_config={"seed": 7},
                              text_aggregation_mode=TextAggregationMode.TOKEN)
    async with pipeline(tts) as run:
        session = tts.session_id
        if proxy is not None:
            proxy.limits["down"] = proxy.passed["down"] + 60_000  # about 2 s into the reply's 16 kHz audio
        await run.send(llm_reply(REPLY))
        await run.sink.wait_for(lambda fs: any(isinstance(f, TTSStoppedFrame) for f in fs))
        assert tts.session_id == session, "the same server session served the whole turn"
        assert not run.errors.errors
        audio = b"".join(f.audio for f in run.sink.of(TTSAudioRawFrame))
        return audio, [w.text for w in spoken_words(run.sink.frames)], tts


async def test_a_connection_dropped_mid_reply_resumes_and_the_turn_plays_whole_once(server: ServerThread) -> None:
    """A network blip (the TCP connection cut, no close frame) in the middle of a reply: the service's
    session resumes on a new connection, and the pipeline gets every sample of the reply once, the same as
    an uncut run, with every word."""
    reference, words, _ = await _spoken(server.ws_url)
    sessions = server_count(server, "voicewire_sessions_total")
    async with Proxy(server.port) as proxy:
        audio, resumed_words, tts = await _spoken(proxy.url(), proxy)
        assert proxy.cut.is_set()
    assert tts._session is None  # closed at the EndFrame
    assert server_count(server, "voicewire_sessions_total") == sessions + 1, "resumed, not reopened"
    assert server_count(server, "voicewire_resumes_succeeded_total") >= 1
    assert len(audio) == len(reference) and audio == reference
    assert resumed_words == words
