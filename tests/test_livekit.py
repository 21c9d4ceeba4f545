"""The LiveKit Agents plugin (`voicewire_client.livekit`) driven through LiveKit's own TTS API, against a
real server on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

pytest.importorskip("livekit.agents")

from livekit.agents import APIError, tts
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT, TimedString
from voicewire_client import livekit as voicewire

from tests.llm_text import LONG_REPLY, REPLY, llm_tokens
from tests.proxy import Proxy
from tests.server import ServerThread

RATE = 16000


async def collect(events: AsyncIterator[tts.SynthesizedAudio]) -> tuple[list[tts.SynthesizedAudio], list[TimedString]]:
    audio: list[tts.SynthesizedAudio] = []
    words: list[TimedString] = []
    async for ev in events:
        audio.append(ev)
        words.extend(ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []))
    return audio, words


def server_count(server: ServerThread, name: str, **labels: str) -> float:
    return server.ctx.metrics.registry.get_sample_value(name, labels) or 0.0


def seconds(audio: list[tts.SynthesizedAudio]) -> float:
    return sum(ev.frame.duration for ev in audio)


def assert_aligned(words: list[TimedString], text: str, duration: float) -> None:
    """The timed words spell the text exactly and are in order on the segment's timeline."""
    assert "".join(words) == text.rstrip()
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert all(0 <= w.start_time < w.end_time <= duration + 0.05 for w in words)  # type: ignore[operator]


@pytest.fixture
async def plugin(server: ServerThread) -> AsyncIterator[voicewire.TTS]:
    speech = voicewire.TTS(url=server.ws_url, voice="heart", sample_rate=RATE)
    yield speech
    await speech.aclose()


def test_capabilities_say_streaming_with_aligned_transcripts() -> None:
    speech = voicewire.TTS(sample_rate=RATE)
    assert speech.capabilities.streaming and speech.capabilities.aligned_transcript
    assert speech.sample_rate == RATE and speech.num_channels == 1
    with pytest.raises(ValueError, match="response_format"):
        voicewire.TTS(session_config={"response_format": "mp3"})


async def test_a_stream_of_llm_tokens_gives_audio_frames_and_timed_words(plugin: voicewire.TTS) -> None:
    async with plugin.stream() as stream:
        for token in llm_tokens(REPLY):
            stream.push_text(token)
        stream.flush()
        stream.end_input()
        audio, words = await collect(stream)
    assert audio and all(ev.frame.sample_rate == RATE and ev.frame.num_channels == 1 for ev in audio)
    assert len({ev.segment_id for ev in audio}) == 1 and audio[-1].is_final
    assert sum(ev.is_final for ev in audio) == 1
    duration = seconds(audio)
    assert 2.0 < duration < 15.0
    assert_aligned(words, REPLY, duration)


async def test_synthesize_speaks_a_sentence_with_timed_words(plugin: voicewire.TTS) -> None:
    sentence = "The weather today is sunny and warm."
    async with plugin.synthesize(sentence) as chunked:
        audio, words = await collect(chunked)
    duration = seconds(audio)
    assert 1.0 < duration < 8.0
    assert all(ev.frame.sample_rate == RATE for ev in audio)
    assert_aligned(words, sentence, duration)


async def test_segments_and_requests_reuse_one_socket(plugin: voicewire.TTS) -> None:
    for text in ["First segment here.", "Second segment here."]:
        async with plugin.stream() as stream:
            stream.push_text(text)
            stream.end_input()
            audio, words = await collect(stream)
        assert_aligned(words, text, seconds(audio))
    async with plugin.synthesize("And one more.") as chunked:
        await collect(chunked)
    assert plugin.connections_opened == 1


async def test_closing_a_stream_mid_utterance_cancels_it_and_the_socket_serves_the_next(
        plugin: voicewire.TTS, server: ServerThread) -> None:
    stream = plugin.stream()
    for token in llm_tokens(LONG_REPLY):
        stream.push_text(token)
    stream.end_input()
    first = await anext(stream)
    assert first.frame.duration > 0
    sessions = server_count(server, "voicewire_sessions_total")
    cancelled = server_count(server, "voicewire_units_total", outcome="cancelled")
    await stream.aclose()

    sentence = "After the interruption."
    async with plugin.stream() as stream:
        stream.push_text(sentence)
        stream.end_input()
        audio, words = await collect(stream)
    # nothing of the cancelled utterance leaks in: the audio and words are this sentence's alone
    assert_aligned(words, sentence, seconds(audio))
    assert seconds(audio) < 5.0
    assert plugin.connections_opened == 1
    assert server_count(server, "voicewire_sessions_total") == sessions  # no new socket
    assert server_count(server, "voicewire_units_total", outcome="cancelled") > cancelled  # input.cancel reached it


async def test_a_pooled_socket_the_server_dropped_is_replaced(plugin: voicewire.TTS, server: ServerThread) -> None:
    async with plugin.synthesize("Hello.") as chunked:
        await collect(chunked)
    (pooled,) = plugin._pool._available

    async def drop() -> None:
        runtime = next(r for r in server.ctx.sessions if r.session_id == pooled.updated.session_id)  # type: ignore
        await runtime.shutdown(1001, "going away")  # the server ends the session (a close frame: no resume)

    server.call(drop)
    async with plugin.synthesize("Hello again.") as chunked:
        audio, words = await collect(chunked)
    assert_aligned(words, "Hello again.", seconds(audio))
    assert plugin.connections_opened == 2


async def test_a_refused_config_is_an_api_error_that_is_not_retried(server: ServerThread) -> None:
    speech = voicewire.TTS(url=server.ws_url, voice="no-such-voice", sample_rate=RATE)
    try:
        with pytest.raises(APIError, match="no-such-voice") as caught:
            async with speech.synthesize("Hello.") as chunked:
                await collect(chunked)
        assert not caught.value.retryable
    finally:
        await speech.aclose()


async def _streamed(url: str, proxy: Proxy | None = None) -> tuple[bytes, list[TimedString], int]:
    """`REPLY` as LLM tokens through a plugin on `url` (the connection cut about 2 s into its 16 kHz audio
    when a `proxy` is given): the audio and timed words LiveKit got, and the sockets the plugin opened."""
    speech = voicewire.TTS(url=url, voice="heart", sample_rate=RATE, session_config={"seed": 7})
    try:
        if proxy is not None:
            proxy.limits["down"] = 60_000
        async with speech.stream() as stream:
            for token in llm_tokens(REPLY):
                stream.push_text(token)
            stream.end_input()
            audio, words = await collect(stream)
        return b"".join(bytes(ev.frame.data) for ev in audio), words, speech.connections_opened
    finally:
        await speech.aclose()


async def test_a_connection_dropped_mid_reply_resumes_and_the_segment_plays_whole_once(server: ServerThread) -> None:
    """A network blip (the TCP connection cut, no close frame) in the middle of a segment: the plugin's
    session resumes on a new connection by itself, and LiveKit gets every sample of the segment once, the
    same as an uncut run, with the same timed words."""
    reference, words, _ = await _streamed(server.ws_url)
    sessions = server_count(server, "voicewire_sessions_total")
    resumed = server_count(server, "voicewire_resumes_succeeded_total")
    async with Proxy(server.port) as proxy:
        audio, resumed_words, opened = await _streamed(proxy.url(), proxy)
        assert proxy.cuts == 1
    assert opened == 1 and server_count(server, "voicewire_sessions_total") == sessions + 1, "resumed, not reopened"
    assert server_count(server, "voicewire_resumes_succeeded_total") == resumed + 1
    assert len(audio) == len(reference) and audio == reference
    timed = [(str(w), w.start_time, w.end_time) for w in words]
    assert [(str(w), w.start_time, w.end_time) for w in resumed_words] == timed and len(timed) > 5
