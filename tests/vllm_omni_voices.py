"""Voice files as vllm-omni's speech server writes them (its `$SPEAKER_SAMPLES_DIR`), for the import tests.

`write_audio_voice` and `write_embedding_voice` write what `OmniOpenAIServingSpeech.upload_voice` and
`upload_voice_embedding` (`vllm_omni/entrypoints/openai/serving_speech.py`, 0.26.0 and 0.30.0 alike) write:
the file name `<name>_<consent>_<created_at>.safetensors` through its `_sanitize_filename`, the header
built by `_speaker_metadata_to_header` from the same `speaker_data` keys (every value a string, None ones
left out, `file_path` never stored), and the tensor `audio` (float32, as `soundfile.read` decoded the
upload: samples, or samples x channels) or `speaker_embedding`. It uses `safetensors.numpy`, so the tests
of the main environment need no vllm-omni; `test_omni_engine.py` checks these files against the ones
vllm-omni's own writer makes, and imports voices written by that writer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def sanitize(text: str) -> str:
    """vllm-omni's `_sanitize_filename`: the base name, every character but `A-Za-z0-9_.-` made `_`."""
    return re.sub(r"[^a-zA-Z0-9_.\-]", "_", os.path.basename(text))[:255] or "file"


def _save(directory: Path, name: str, consent: str, created_at: int, tensors: dict[str, np.ndarray],
          speaker_data: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{sanitize(name)}_{sanitize(consent)}_{created_at}.safetensors"
    save_file(tensors, str(path), metadata={k: str(v) for k, v in speaker_data.items() if v is not None})
    return path


def write_audio_voice(directory: Path, name: str, audio: np.ndarray, rate: int, *, created_at: int,
                      consent: str = "consent-1", ref_text: str | None = None,
                      speaker_description: str | None = None, filename: str = "sample.wav",
                      mime_type: str = "audio/wav", file_size: int = 1234) -> Path:
    """An uploaded audio voice as `upload_voice` stores it; returns its path."""
    speaker_data: dict[str, object] = {
        "name": name, "voice_name_lower": name.lower(), "consent": consent, "created_at": created_at,
        "mime_type": mime_type, "original_filename": filename, "file_size": file_size, "sample_rate": int(rate),
        "ref_text": ref_text, "embedding_source": "audio"}
    if speaker_description:
        speaker_data["speaker_description"] = speaker_description
    return _save(directory, name, consent, created_at, {"audio": np.ascontiguousarray(audio, dtype=np.float32)},
                 speaker_data)


def write_embedding_voice(directory: Path, name: str, embedding: list[float], *, created_at: int,
                          consent: str = "consent-1") -> Path:
    """A voice uploaded as a speaker embedding, as `upload_voice_embedding` stores it; returns its path."""
    filename = f"{sanitize(name)}_{sanitize(consent)}_{created_at}.safetensors"
    speaker_data: dict[str, object] = {
        "name": name, "voice_name_lower": name.lower(), "consent": consent, "created_at": created_at,
        "mime_type": "application/x-safetensors", "original_filename": filename, "embedding_source": "direct",
        "embedding_dim": len(embedding)}
    return _save(directory, name, consent, created_at,
                 {"speaker_embedding": np.asarray(embedding, dtype=np.float32)}, speaker_data)


def tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    """A 220 Hz tone at 0.3 of full scale: samples, or samples x channels."""
    t = np.arange(int(rate * seconds)) / rate
    mono = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return mono if channels == 1 else np.repeat(mono[:, None], channels, axis=1)
