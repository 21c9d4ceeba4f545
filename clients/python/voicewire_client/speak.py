"""Helpers over a `Session`: speak a text stream (an LLM's tokens) and get its events or its audio.

`stream()` sends the text as it arrives while it yields the utterance's events, so synthesis starts on
the first sentence while the rest is still being generated. `speak()` collects the result: decoded
audio, word timings, the server's timings and the client-measured time to first audio.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field

import numpy as np

from voicewire_client.audio import DECODABLE_FORMATS, Audio, Int16Array, UnitDecoder
from voicewire_client.events import (
    AudioCancelled,
    AudioData,
    AudioStart,
    AudioWords,
    ErrorEvent,
    Event,
    SessionDone,
    WordTiming,
)
from voicewire_client.session import ServerError, Session, SessionClosedError

TextSource = str | Iterable[str] | AsyncIterable[str]
"""Text to speak: one string, or deltas (sync or async iterable) sent as they come."""


async def _deltas(text: TextSource) -> AsyncIterator[str]:
    if isinstance(text, str):
        yield text
    elif isinstance(text, AsyncIterable):
        async for delta in text:
            yield delta
    else:
        for delta in text:
            yield delta


async def stream(session: Session, text: TextSource, *, context_id: str | None = None) -> AsyncIterator[Event]:
    """Speak `text` as one utterance: send its deltas as they arrive (then `done()`), and yield the
    utterance's events up to and including its `SessionDone` (or `AudioCancelled`).

    Raises `ServerError` on an `error` event and `SessionClosedError` when the socket closes first.
    Leaving the loop early (break, exception, task cancel) cancels the utterance on the server.
    """
    index = session.current_utterance_index
    finished = False

    async def send_all() -> None:
        async for delta in _deltas(text):
            if delta:
                await session.send_text(delta, context_id=context_id)
        await session.done(context_id=context_id)

    sender = asyncio.create_task(send_all(), name="voicewire-client-sender")
    try:
        async for event in _events_while_sending(session, sender):
            if isinstance(event, ErrorEvent):
                raise ServerError(event)
            yield event
            if isinstance(event, SessionDone | AudioCancelled) and event.utterance_index == index:
                finished = True
                break
        if not finished:
            raise SessionClosedError(session.close_code, session.close_reason)
        await sender
    finally:
        if not sender.done():
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender
        if not finished and session.close_code is None:
            with contextlib.suppress(Exception):
                await session.cancel(context_id=context_id)


async def _events_while_sending(session: Session, sender: asyncio.Task[None]) -> AsyncIterator[Event]:
    """The session's events; re-raises the sender's exception as soon as it fails (a failing text
    source must not leave the caller waiting for audio that will never come)."""
    receiving: asyncio.Future[Event] | None = None
    try:
        while True:
            if receiving is None:
                receiving = asyncio.ensure_future(anext(session))
            if sender.done():
                await asyncio.wait((receiving,))
            else:
                await asyncio.wait((receiving, sender), return_when=asyncio.FIRST_COMPLETED)
            if sender.done() and sender.exception() is not None:
                raise sender.exception()  # type: ignore[misc]
            if not receiving.done():
                continue
            done, receiving = receiving, None
            try:
                event = done.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if receiving is not None and not receiving.done():
            receiving.cancel()


@dataclass(slots=True)
class SpeechResult:
    """One spoken utterance. `first_audio_s` is measured here: from sending the first text to receiving
    the first audio bytes (network and server included); `done.first_audio_ms` is the server's part."""

    audio: Audio
    words: list[WordTiming] = field(default_factory=list)
    units: list[AudioStart] = field(default_factory=list)
    done: SessionDone | None = None
    first_audio_s: float | None = None


class SpeechCollector:
    """Accumulates one utterance's events (`add`), then builds its `SpeechResult` (`finish`), decoding
    audio unit by unit as it arrives."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.first_audio_s: float | None = None
        self.units: list[AudioStart] = []
        self.words: list[WordTiming] = []
        self.done: SessionDone | None = None
        self._chunks: list[Int16Array] = []
        self._encoded: list[bytes] = []
        self._decoder: UnitDecoder | None = None

    async def timed(self, text: TextSource) -> AsyncIterator[str]:
        """Pass `text` through as deltas, starting the time-to-first-audio clock at the first one."""
        first = True
        async for delta in _deltas(text):
            if first and delta:
                self.started = time.monotonic()
                first = False
            yield delta

    def add(self, event: Event) -> Int16Array | None:
        """Take one event; returns the samples decoded from it, if it carried decodable audio."""
        if isinstance(event, AudioStart):
            self.units.append(event)
            self._decoder = UnitDecoder(event.format) if event.format in DECODABLE_FORMATS else None
        elif isinstance(event, AudioData):
            if self.first_audio_s is None:
                self.first_audio_s = time.monotonic() - self.started
            if self._decoder is None:
                self._encoded.append(event.data)
                return None
            samples = self._decoder.feed(event.data)
            self._chunks.append(samples)
            return samples
        elif isinstance(event, AudioWords):
            self.words.extend(event.words)
        elif isinstance(event, SessionDone):
            self.done = event
        return None

    def finish(self) -> SpeechResult:
        last = self.units[-1] if self.units else None
        samples = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        audio = Audio(samples, last.sample_rate if last else 0, last.format if last else "pcm",
                      b"".join(self._encoded))
        return SpeechResult(audio, self.words, self.units, self.done, self.first_audio_s)


async def speak(session: Session, text: TextSource, *, context_id: str | None = None) -> SpeechResult:
    """Speak `text` (see `stream()` for how it is sent and the errors raised) and return the whole
    utterance: audio decoded to int16 (formats pcm/wav/mulaw/alaw; others kept in `audio.encoded`),
    words on the utterance timeline, and timings."""
    collector = SpeechCollector()
    async for event in stream(session, collector.timed(text), context_id=context_id):
        collector.add(event)
    return collector.finish()
