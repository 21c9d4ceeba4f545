"""The engine's data types: what an engine is asked (`SynthesisRequest`), what it yields (`AudioPiece`) and
what it tells about itself (`EngineInfo`). Plain data, the ground floor: `adapters/` (the engines) and
`realtime/` both build on these; the `Engine` protocol itself is in `adapters/base.py`.

An engine turns one synthesis unit (a sentence or clause of an utterance) into audio. The shape follows
vLLM's async generator per request: `synthesize(request)` returns an async generator of `AudioPiece`s, and
closing or cancelling that iterator is the only cancel API. Every engine must stop the computation for a
request promptly when its iterator is closed (`aclose()`) or the task consuming it is cancelled, and must
not leak threads, buffers or device memory for it.

Engines do no scheduling across sessions: the realtime scheduler decides which request runs next and how
many run at once (`EngineInfo.max_concurrency`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

FloatAudio = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class WordSpan:
    """One spoken word of a unit.

    `char_start`/`char_end` index the unit's text (Python string offsets, end exclusive) and cover the
    word as written, without surrounding whitespace. `start_sample`/`end_sample` count samples at the
    engine's native rate from the first sample of the unit's audio (end exclusive).
    """

    char_start: int
    char_end: int
    start_sample: int
    end_sample: int


@dataclass(frozen=True, slots=True)
class AudioPiece:
    """A run of mono float32 samples in [-1, 1] at `sample_rate`, in playback order.

    `words` holds the spans whose audio ends inside this piece or earlier pieces of the same unit and
    were not reported before; an engine without word timings leaves it empty.
    """

    samples: FloatAudio
    sample_rate: int
    words: tuple[WordSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class SynthesisRequest:
    """One unit to synthesize.

    `speed` is within the engine's native range (`EngineCapabilities.speed_range`); the caller does any
    time-stretch beyond it. `seed`, when set, makes the audio of the same request reproducible.
    `request_id` is unique per server and is what the engine logs and aborts by.
    """

    request_id: str
    text: str
    voice: str
    speed: float = 1.0
    language: str | None = None
    seed: int | None = None
    instructions: str | None = None
    options: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine can honour; the session refuses config fields an engine cannot honour."""

    word_timings: bool
    voice_cloning: bool
    speed_range: tuple[float, float]
    instructions: bool = False
    seed: bool = False
    streaming: str = "unit"
    """`unit`: each request yields its audio once it is computed; `frame`: audio arrives in small chunks."""
    codec_frames: bool = False
    """Honours `max_new_tokens` and `initial_codec_chunk_frames` (codec-token talkers)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Static facts about a started engine, published to clients in `session.updated.engine`."""

    name: str
    sample_rate: int
    voices: tuple[str, ...]
    default_voice: str
    languages: tuple[str, ...]
    capabilities: EngineCapabilities
    max_concurrency: int
    """How many requests the engine computes at once; the scheduler never runs more than this."""
