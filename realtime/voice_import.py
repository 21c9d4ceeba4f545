"""Import the voices a vllm-omni speech server stored into the voice store, at start
(`voicewire serve --import-vllm-omni-voices DIR`, or `$VOICEWIRE_IMPORT_VLLM_OMNI_VOICES`).

The source format, as vllm-omni 0.26.0 and 0.30.0 both write it (`OmniOpenAIServingSpeech.upload_voice`
and `upload_voice_embedding` in `vllm_omni/entrypoints/openai/serving_speech.py`; its directory is
`$SPEAKER_SAMPLES_DIR`, by default `~/.cache/vllm-omni/speakers`): one safetensors file per voice, named
`<name>_<consent>_<created_at>.safetensors` (name and consent sanitized), every fact in the header as a
string: `name`, `voice_name_lower`, `consent`, `created_at`, `mime_type`, `original_filename`,
`file_size`, `sample_rate`, `ref_text`, `speaker_description`, `embedding_source`. An `audio` voice holds
the decoded upload as the float32 tensor `audio` (samples, or samples x channels); a `direct` voice holds
only a `speaker_embedding` (`embedding_dim` floats).

What the import does, each start, before any request is served:
- It reads the directory and never writes to it. Each voice becomes an ordinary voicewire voice of the
  same name (looked up case-insensitively, as vllm-omni does) with its consent, `created_at`, ref_text,
  speaker description, file size and media type; multichannel audio is mixed down to mono, audio above
  48 kHz resampled to 48 kHz (as an upload would be). The stored voice's header names the source file
  (`imported_from`).
- Per name (case-insensitive, vllm-omni's key) the file with the newest `created_at` is the voice; older
  files of that name are skipped as superseded.
- Idempotent: a voice already imported from the same file is left alone (no duplicate, no rewrite); one
  imported earlier from an older vllm-omni file of that name is replaced by the newer one. A voice
  uploaded to voicewire is never overwritten: the vllm-omni voice of that name is skipped. So an imported
  voice deleted through voicewire comes back at the next start while its file is in the directory and the
  option is set; take the option off once the migration is done. A voice whose file leaves the directory
  stays in voicewire.
- Each voice is written the way an upload is (temporary file, fsync, atomic rename), so a crash leaves
  whole voices only, and the next start imports the rest.
- A file that cannot be imported is skipped with one warning naming the file and why: unreadable header,
  no name or consent, a name voicewire does not take or that is a built-in voice or alias, a speaker
  embedding voice (the store holds reference audio only), no or malformed audio, a sample rate or length
  an upload would be refused for, the voice cap, a full disk. One line sums up the counts.

A missing or unreadable directory is a startup error (`check_source`), not a silent empty import.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np
from safetensors import safe_open
from voicewire.protocol.audio import resample
from voicewire.protocol.engine import FloatAudio
from voicewire.protocol.media import MAX_CHANNELS, MAX_INPUT_RATE, MAX_OUTPUT_RATE
from voicewire.realtime.voices import (
    MAX_SECONDS,
    MIN_SECONDS,
    VoiceRecord,
    VoiceStore,
    VoiceStoreError,
    check_name,
    known_mime_type,
)

log = logging.getLogger("voicewire.voices")

ENV_VAR: Final = "VOICEWIRE_IMPORT_VLLM_OMNI_VOICES"
_SUFFIX: Final = ".safetensors"
_AUDIO_SOURCE: Final = "audio"
_MIME_ALIASES: Final = {"audio/x-wav": "audio/wav"}
"""vllm-omni's accepted upload types that name a container voicewire knows by another type."""


@dataclass(slots=True)
class ImportReport:
    """What one import did: voice names imported, updated (a newer vllm-omni file) and already imported,
    and `(file name, reason)` for each file skipped."""

    imported: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


class _Skip(Exception):
    """A file that is not imported; the message says why."""


@dataclass(frozen=True, slots=True)
class _Source:
    """One vllm-omni voice file whose header names a voice and its creation time."""

    path: Path
    header: dict[str, str]
    name: str
    created_at: int


def check_source(directory: Path, voices_dir: Path) -> None:
    """Raise ValueError unless `directory` is a readable directory other than the voice store's own."""
    flag = "--import-vllm-omni-voices"
    if not directory.exists():
        raise ValueError(f"{flag} {directory}: no such directory")
    if not directory.is_dir():
        raise ValueError(f"{flag} {directory}: not a directory")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise ValueError(f"{flag} {directory}: cannot be read (permission denied)")
    if voices_dir.exists() and directory.resolve() == voices_dir.resolve():
        raise ValueError(f"{flag} {directory}: this is voicewire's own voices directory (--voices-dir); "
                         "name vllm-omni's voice directory ($SPEAKER_SAMPLES_DIR)")


async def import_vllm_omni_voices(store: VoiceStore, directory: Path, *, reserved: tuple[str, ...]) -> ImportReport:
    """Import every voice of vllm-omni's voice directory `directory` into `store` (module docstring);
    `reserved` are the names voices may not take (engine voices and aliases). Logs each skip and a summary."""
    report = ImportReport()
    sources = await asyncio.to_thread(_newest_per_name, directory, report)
    for source in sources:
        try:
            await _import_one(store, source, reserved, report)
        except _Skip as skip:
            report.skipped.append((source.path.name, str(skip)))
    for file_name, reason in report.skipped:
        log.warning("vllm-omni voice file %s not imported: %s", directory / file_name, reason)
    level = logging.WARNING if report.skipped else logging.INFO
    log.log(level, "vllm-omni voices from %s: %d imported, %d updated, %d already imported, %d skipped",
            directory, len(report.imported), len(report.updated), len(report.unchanged), len(report.skipped))
    return report


async def _import_one(store: VoiceStore, source: _Source, reserved: tuple[str, ...], report: ImportReport) -> None:
    header = source.header
    if header.get("embedding_source", _AUDIO_SOURCE) != _AUDIO_SOURCE:
        raise _Skip(f"voice {source.name!r} is a speaker embedding (embedding_source "
                    f"{header['embedding_source']!r}); voicewire stores voices as reference audio only, so "
                    "upload this speaker's audio to voicewire instead")
    try:
        check_name(source.name, reserved)
    except VoiceStoreError as exc:
        raise _Skip(exc.message) from None
    if not header.get("consent", "").strip():
        raise _Skip(f"voice {source.name!r} has no consent in its header (voicewire stores a voice only with one)")
    existing = store.get(source.name)
    if existing is not None and existing.imported_from is None:
        raise _Skip(f"a voice named {existing.name!r} was uploaded to voicewire; it is kept (delete it and "
                    "restart to import this one)")
    if existing is not None and existing.imported_from == source.path.name:
        report.unchanged.append(existing.name)
        return
    if existing is not None and existing.created_at >= source.created_at:
        raise _Skip(f"voice {existing.name!r} was imported from the newer file {existing.imported_from}; it is kept")
    record, audio = await asyncio.to_thread(_read_voice, source)
    try:
        await store.put_imported(record, audio)
    except VoiceStoreError as exc:
        raise _Skip(exc.message) from None
    (report.imported if existing is None else report.updated).append(record.name)
    log.info("imported vllm-omni voice %r from %s", record.name, source.path)


def _newest_per_name(directory: Path, report: ImportReport) -> list[_Source]:
    """Every voice file's header, the newest file per case-insensitive name (older ones skipped)."""
    newest: dict[str, _Source] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix != _SUFFIX or path.name.startswith(".") or not path.is_file():
            continue
        try:
            source = _read_header(path)
        except _Skip as skip:
            report.skipped.append((path.name, str(skip)))
            continue
        key = source.name.lower()
        if key in newest:
            older, source = sorted((newest[key], source), key=lambda s: (s.created_at, s.path.name))
            report.skipped.append((older.path.name, f"voice {older.name!r} is superseded by the newer file "
                                                    f"{source.path.name} of that name"))
        newest[key] = source
    return sorted(newest.values(), key=lambda s: s.name.lower())


def _read_header(path: Path) -> _Source:
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = dict(f.metadata() or {})
    except Exception as exc:
        raise _Skip(f"not a readable safetensors file ({exc})") from None
    name = (header.get("name") or header.get("voice_name_lower") or "").strip()
    if not name:
        raise _Skip("no voice name in its header")
    try:
        created_at = int(header.get("created_at", ""))
    except ValueError:
        raise _Skip(f"voice {name!r}: created_at {header.get('created_at')!r} is not a whole number") from None
    return _Source(path, header, name, created_at)


def _read_voice(source: _Source) -> tuple[VoiceRecord, FloatAudio]:
    """The voice's record and mono float32 audio, checked as an upload's would be (blocking)."""
    header, name = source.header, source.name
    try:
        rate = int(header.get("sample_rate", ""))
    except ValueError:
        raise _Skip(f"voice {name!r}: sample_rate {header.get('sample_rate')!r} is not a whole number") from None
    if not 0 < rate <= MAX_INPUT_RATE:
        raise _Skip(f"voice {name!r}: a sample rate of {rate} Hz is not supported "
                    f"(accepted: up to {MAX_INPUT_RATE} Hz)")
    try:
        with safe_open(str(source.path), framework="numpy") as f:
            if "audio" not in f.keys():
                raise _Skip(f"voice {name!r} holds no audio tensor")
            piece = f.get_slice("audio")
            shape, dtype = list(piece.get_shape()), piece.get_dtype()
            if dtype != "F32" or len(shape) not in (1, 2) or (len(shape) == 2 and not 1 <= shape[1] <= MAX_CHANNELS):
                raise _Skip(f"voice {name!r}: its audio is a {dtype} tensor of shape {shape} (expected float32 "
                            f"samples, or samples x 1-{MAX_CHANNELS} channels)")
            seconds = shape[0] / rate
            if not MIN_SECONDS <= seconds <= MAX_SECONDS:
                raise _Skip(f"voice {name!r} holds {seconds:.2f} s of audio (accepted: {MIN_SECONDS:g} to "
                            f"{MAX_SECONDS:g} s)")
            samples = np.asarray(f.get_tensor("audio"), dtype=np.float32)
    except _Skip:
        raise
    except Exception as exc:
        raise _Skip(f"voice {name!r}: its audio cannot be read ({exc})") from None
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise _Skip(f"voice {name!r} holds non-finite samples")
    if rate > MAX_OUTPUT_RATE:
        samples, rate = resample(samples, rate, MAX_OUTPUT_RATE), MAX_OUTPUT_RATE
    try:
        file_size = int(header.get("file_size", ""))
    except ValueError:
        file_size = source.path.stat().st_size
    mime_type = header.get("mime_type", "")
    record = VoiceRecord(
        name=name, consent=header["consent"], created_at=source.created_at, sample_rate=rate,
        duration_s=len(samples) / rate, file_size=file_size,
        mime_type=known_mime_type(_MIME_ALIASES.get(mime_type, mime_type)),
        ref_text=header.get("ref_text") or None, speaker_description=header.get("speaker_description") or None,
        imported_from=source.path.name)
    return record, samples
