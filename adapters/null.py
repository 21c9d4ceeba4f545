"""The null engine: a benchmark stand-in that returns audio instantly.

It measures the serving path alone (segmenting, scheduling, rendering, sending) with the engine's cost
taken out. It is never an engine that "works": it speaks a quiet tone, 60 ms per character, with one
evenly spaced word span per whitespace-separated word. Selected with `--engine null`; no test counts it
as synthesis.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator

import numpy as np
from voicewire.adapters.registry import NULL
from voicewire.protocol.engine import AudioPiece, EngineCapabilities, EngineInfo, SynthesisRequest, WordSpan

SAMPLE_RATE = 24000
SECONDS_PER_CHAR = 0.06
_WORD = re.compile(r"\S+")


class NullEngine:
    """Instant audio of a plausible length; see the module docstring."""

    def __init__(self, max_concurrency: int = 64) -> None:
        self._info = EngineInfo(
            name="null", sample_rate=SAMPLE_RATE, voices=("null",), default_voice="null", languages=("en",),
            capabilities=EngineCapabilities(word_timings=NULL.word_timings, voice_cloning=False,
                                            speed_range=(0.25, 4.0), fields=NULL.fields, values=NULL.values),
            max_concurrency=max_concurrency)
        t = np.arange(SAMPLE_RATE, dtype=np.float32) / SAMPLE_RATE
        self._tone = (0.05 * np.sin(2 * np.pi * 220.0 * t)).astype(np.float32)

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        n = int(len(request.text) * SECONDS_PER_CHAR / request.speed * SAMPLE_RATE)
        samples = np.resize(self._tone, n)
        words = list(_WORD.finditer(request.text))
        per = n // max(1, len(words))
        spans = tuple(WordSpan(m.start(), m.end(), i * per, (i + 1) * per) for i, m in enumerate(words))
        yield AudioPiece(samples, SAMPLE_RATE, spans)
