"""Playback through the sound card with `sounddevice` (optional: `pip install voicewire-client[play]`)."""

from __future__ import annotations

import asyncio
import importlib.util
from types import TracebackType
from typing import Any

from voicewire_client.audio import Int16Array
from voicewire_client.session import VoicewireError


def sounddevice_available() -> bool:
    """True when `sounddevice` is installed (it also needs the PortAudio library at run time)."""
    return importlib.util.find_spec("sounddevice") is not None


class SoundCardPlayer:
    """Plays mono int16 samples on the default output device as they are written.

    `write()` returns once the samples are queued in the device buffer (it waits, in a worker thread,
    while that buffer is full, so a fast server is paced by the sound card). `close()` lets the queued
    audio finish; `abort()` drops it at once (barge-in).
    """

    def __init__(self, sample_rate: int) -> None:
        try:
            import sounddevice
        except (ImportError, OSError) as exc:
            raise VoicewireError(f"cannot play audio: {exc}; install voicewire-client[play] (and PortAudio), "
                                 "or write a file with -o") from None
        self.sample_rate = sample_rate
        self._stream: Any = sounddevice.RawOutputStream(samplerate=sample_rate, channels=1, dtype="int16")
        self._stream.start()

    async def write(self, samples: Int16Array) -> None:
        if len(samples):
            await asyncio.to_thread(self._stream.write, samples.astype("<i2").tobytes())

    async def close(self) -> None:
        await asyncio.to_thread(self._stream.stop)
        self._stream.close()

    def abort(self) -> None:
        self._stream.abort()
        self._stream.close()

    async def __aenter__(self) -> SoundCardPlayer:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is None:
            await self.close()
        else:
            self.abort()
