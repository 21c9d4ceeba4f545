"""Uploaded voices: validated, stored one safetensors file per voice, restored on restart.

A voice is one file `<dir>/<name>.safetensors` holding the decoded reference audio (tensor `audio`:
float32 mono samples) and every bit of metadata (name, consent, sample rate, ref_text, ...) in the
safetensors header, so a voice is either wholly on disk or not at all: there is no second file to get out
of step. Files are written to a hidden temporary name in the same directory, fsynced, then renamed over the
final name with `os.replace` (atomic on POSIX) and the directory fsynced; a crash mid-upload leaves at
worst a hidden `.*.tmp` file, which the next start deletes and never registers.

Validation before anything is written: the name (1-64 of `A-Z a-z 0-9 _ -`, starting with a letter or
digit, so no path separators, dots or traversal; not an engine voice or alias), consent (non-empty), the
upload size (`max_upload_bytes`), the audio (decoded by `protocol.media.decode_audio`: an allowlisted
container sniffed from its bytes, from memory, no file or network ever opened, stopped as soon as it
passes 30 s; finite samples; at least 1 s) and the number of voices (`max_voices`). The stored media type
is the detected container's, never the type the client claimed.

A full disk (ENOSPC, EDQUOT) while writing is a `VoiceStoreError` 507 (`insufficient_storage`); the
temporary file is removed and the store carries on with the voices it had.

Concurrency: `add` and `remove` run under one asyncio lock; disk work runs in a worker thread. Lookups
(`__contains__`, `get`) read an in-memory dict and are safe from any task. Memory: metadata only; the
audio is read back from disk by `load_audio` when an engine needs it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as safetensors_bytes
from voicewire.protocol.engine import FloatAudio
from voicewire.protocol.media import CONTAINERS, MediaError, decode_audio

log = logging.getLogger("voicewire.voices")

NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MIN_SECONDS: Final = 1.0
MAX_SECONDS: Final = 30.0
FORMAT_VERSION: Final = "1"
_SUFFIX: Final = ".safetensors"
_TMP_SUFFIX: Final = ".tmp"
_MIME_TYPES: Final = frozenset(c.mime_type for c in CONTAINERS)
_UNKNOWN_MIME: Final = "application/octet-stream"


class VoiceStoreError(Exception):
    """A refused voice operation: `status` (400, 404, 413, 507), the offending form field `param`, a stable
    `code`, and a message for humans."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class VoiceRecord:
    """One stored voice's metadata (what `GET /v1/audio/voices` lists)."""

    name: str
    consent: str
    created_at: int
    sample_rate: int
    duration_s: float
    file_size: int
    """Bytes of the uploaded sample, as vllm-omni reports it."""
    mime_type: str
    ref_text: str | None = None
    speaker_description: str | None = None

    def public(self) -> dict[str, object]:
        """vllm-omni's listing shape; `ref_text`/`speaker_description` only when given."""
        out: dict[str, object] = {
            "name": self.name, "consent": self.consent, "created_at": self.created_at,
            "file_size": self.file_size, "mime_type": self.mime_type, "sample_rate": self.sample_rate,
            "duration_s": round(self.duration_s, 3)}
        if self.ref_text is not None:
            out["ref_text"] = self.ref_text
        if self.speaker_description is not None:
            out["speaker_description"] = self.speaker_description
        return out

    def header(self) -> dict[str, str]:
        """The safetensors metadata (string to string) that makes the file self-describing."""
        meta = {"format": "voicewire.voice", "version": FORMAT_VERSION, "name": self.name,
                "consent": self.consent, "created_at": str(self.created_at),
                "sample_rate": str(self.sample_rate), "duration_s": repr(self.duration_s),
                "file_size": str(self.file_size), "mime_type": self.mime_type}
        if self.ref_text is not None:
            meta["ref_text"] = self.ref_text
        if self.speaker_description is not None:
            meta["speaker_description"] = self.speaker_description
        return meta

    @classmethod
    def from_header(cls, meta: dict[str, str]) -> VoiceRecord:
        """Inverse of `header`; raises KeyError/ValueError on a file that is not a voice of this format.
        A media type that is not one the decoder detects (files stored before types were detected held
        the client's string) reads as `application/octet-stream`."""
        if meta.get("format") != "voicewire.voice" or meta.get("version") != FORMAT_VERSION:
            raise ValueError("not a voicewire voice file of a known version")
        mime_type = meta["mime_type"] if meta["mime_type"] in _MIME_TYPES else _UNKNOWN_MIME
        return cls(name=meta["name"], consent=meta["consent"], created_at=int(meta["created_at"]),
                   sample_rate=int(meta["sample_rate"]), duration_s=float(meta["duration_s"]),
                   file_size=int(meta["file_size"]), mime_type=mime_type,
                   ref_text=meta.get("ref_text"), speaker_description=meta.get("speaker_description"))


def default_voices_dir() -> Path:
    """`$XDG_DATA_HOME/voicewire/voices`, or `~/.local/share/voicewire/voices`."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "voicewire" / "voices"


def check_name(name: str, reserved: Collection[str]) -> None:
    """Raise `VoiceStoreError` (400, param `name`) unless `name` is a safe, free voice name."""
    if not NAME_PATTERN.fullmatch(name):
        raise VoiceStoreError(400, "invalid_voice_name",
                              f"invalid voice name {name!r}: use 1-64 letters, digits, '_' or '-', "
                              "starting with a letter or digit", "name")
    if name.lower() in {r.lower() for r in reserved}:
        raise VoiceStoreError(400, "voice_name_taken",
                              f"voice name {name!r} is a built-in voice or alias; choose another name", "name")


def decode_sample(data: bytes, *, max_bytes: int, max_seconds: float = MAX_SECONDS) -> tuple[FloatAudio, int, str]:
    """Decode an uploaded sample (`protocol.media.decode_audio`) to mono float32, its rate and its
    detected media type, or raise `VoiceStoreError` (param `audio_sample`): 413 past `max_bytes`, 400
    for anything else refused, non-finite samples, or under `MIN_SECONDS`."""
    try:
        decoded = decode_audio(data, max_bytes=max_bytes, max_seconds=max_seconds)
    except MediaError as exc:
        status = 413 if exc.code == "upload_too_large" else 400
        raise VoiceStoreError(status, exc.code, f"audio_sample {exc.message}", "audio_sample") from None
    if not np.isfinite(decoded.samples).all():
        raise VoiceStoreError(400, "invalid_audio", "audio_sample holds non-finite samples", "audio_sample")
    if decoded.duration_s < MIN_SECONDS:
        raise VoiceStoreError(400, "invalid_audio_duration",
                              f"audio_sample is shorter than {MIN_SECONDS:g} s ({decoded.duration_s:.2f} s)",
                              "audio_sample")
    return decoded.samples, decoded.sample_rate, decoded.container.mime_type


class VoiceStore:
    """The uploaded voices of one server (see the module docstring for the on-disk contract)."""

    def __init__(self, directory: Path, *, max_voices: int, max_upload_bytes: int) -> None:
        self.directory = directory
        self.max_voices = max_voices
        self.max_upload_bytes = max_upload_bytes
        self._voices: dict[str, VoiceRecord] = {}
        self._lock = asyncio.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._voices

    def __len__(self) -> int:
        return len(self._voices)

    def get(self, name: str) -> VoiceRecord | None:
        return self._voices.get(name)

    def records(self) -> list[VoiceRecord]:
        return sorted(self._voices.values(), key=lambda r: r.name)

    async def restore(self) -> None:
        """Register every valid voice file in the directory; delete temporaries of interrupted uploads."""
        self._voices = await asyncio.to_thread(self._scan)
        log.info("voice store %s: %d voices", self.directory, len(self._voices))

    def _scan(self) -> dict[str, VoiceRecord]:
        found: dict[str, VoiceRecord] = {}
        if not self.directory.is_dir():
            return found
        for path in sorted(self.directory.iterdir()):
            if path.name.startswith(".") and path.name.endswith(_TMP_SUFFIX):
                log.warning("removing %s, left by an interrupted upload", path)
                path.unlink(missing_ok=True)
                continue
            if path.suffix != _SUFFIX or path.name.startswith("."):
                continue
            try:
                with safe_open(str(path), framework="numpy") as f:
                    record = VoiceRecord.from_header(dict(f.metadata() or {}))
            except Exception as exc:
                log.warning("skipping %s: not a readable voice file (%s)", path, exc)
                continue
            if record.name != path.stem or not NAME_PATTERN.fullmatch(record.name):
                log.warning("skipping %s: its name does not match the file name", path)
                continue
            found[record.name] = record
        return found

    async def add(self, *, name: str, sample: bytes, consent: str, ref_text: str | None,
                  speaker_description: str | None, reserved: Collection[str]) -> VoiceRecord:
        """Validate and store one voice (replacing one of the same name); returns its record.

        Raises `VoiceStoreError`; nothing is on disk or registered unless this returns.
        """
        check_name(name, reserved)
        if not consent.strip():
            raise VoiceStoreError(400, "consent_required", "consent is required to store a voice", "consent")
        audio, rate, mime_type = await asyncio.to_thread(decode_sample, sample, max_bytes=self.max_upload_bytes)
        record = VoiceRecord(name=name, consent=consent, created_at=int(time.time()), sample_rate=rate,
                             duration_s=len(audio) / rate, file_size=len(sample), mime_type=mime_type,
                             ref_text=ref_text or None, speaker_description=speaker_description or None)
        async with self._lock:
            if name not in self._voices and len(self._voices) >= self.max_voices:
                raise VoiceStoreError(400, "too_many_voices",
                                      f"the server keeps at most {self.max_voices} voices; delete one first", "name")
            await asyncio.to_thread(self._write, record, audio)
            self._voices[name] = record
        return record

    async def remove(self, name: str) -> None:
        """Delete a voice; raises `VoiceStoreError` (404) when there is none of that name."""
        async with self._lock:
            if name not in self._voices:
                raise VoiceStoreError(404, "voice_not_found", f"voice {name!r} not found", "name")
            await asyncio.to_thread(self._unlink, self._path(name))
            del self._voices[name]

    def load_audio(self, name: str) -> tuple[FloatAudio, int]:
        """The stored samples and rate of a voice (blocking disk read; for cloning engines)."""
        record = self._voices[name]
        with safe_open(str(self._path(name)), framework="numpy") as f:
            audio: FloatAudio = f.get_tensor("audio")
        return audio, record.sample_rate

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}{_SUFFIX}"

    def _write(self, record: VoiceRecord, audio: FloatAudio) -> None:
        data = safetensors_bytes({"audio": np.ascontiguousarray(audio, dtype=np.float32)},
                                 metadata=record.header())
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{record.name}.", suffix=_TMP_SUFFIX, dir=self.directory)
        except OSError as exc:
            if _out_of_space(exc):
                raise _insufficient_storage() from exc
            raise
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(record.name))
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if _out_of_space(exc):
                raise _insufficient_storage() from exc
            raise
        self._fsync_directory()

    def _unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self._fsync_directory()

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _insufficient_storage() -> VoiceStoreError:
    log.error("a voice upload was refused: the voices directory is out of space")
    return VoiceStoreError(507, "insufficient_storage",
                           "the server has no room left to store this voice; try again later")
