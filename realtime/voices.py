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

Names match case-insensitively, as vllm-omni's do: a lookup of `alice` finds the voice stored as `Alice`
(an exact match first, then a known voice whose name differs only in case), `remove` deletes it, and an
upload of `ALICE` replaces it (the new file is written, then the old one removed).

Several servers may share one directory (a shared volume behind a load balancer): the directory is the
truth, and the in-memory dict a cache of it. A lookup (`__contains__`, `get`) checks the voice's file with
one `stat` (a name missing from the cache is looked up on disk; a cached one whose file is gone, or was
replaced through another server, is dropped or re-read), and `records` lists the directory, re-reading only
headers whose file changed. So a voice uploaded or deleted through any server is seen by every other at its
next request, at the cost of one `stat` per lookup and one directory listing per listing request; only a
lookup in another case than the name it was uploaded with through another server waits for this server's
next listing (`records`, which every `GET /v1/audio/voices` does).

Voices imported from a vllm-omni voice directory (`realtime.voice_import`) are ordinary voices here, stored
the same way; their header also names the vllm-omni file they came from (`imported_from`).

Concurrency: `add` and `remove` run under one asyncio lock (per server; across servers the atomic rename
decides: the last upload of a name wins whole); disk writes run in a worker thread; a lookup's `stat` and
(rare) header read run on the caller's thread and are small. Memory: metadata only; the audio is read back
from disk by `load_audio` when an engine needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from voicewire.protocol.messages import echo

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
    imported_from: str | None = None
    """The vllm-omni voice file this voice was imported from (`realtime.voice_import`); None for uploads."""

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
        if self.imported_from is not None:
            meta["imported_from"] = self.imported_from
        return meta

    @classmethod
    def from_header(cls, meta: dict[str, str]) -> VoiceRecord:
        """Inverse of `header`; raises KeyError/ValueError on a file that is not a voice of this format.
        A media type that is not one the decoder detects (files stored before types were detected held
        the client's string) reads as `application/octet-stream`."""
        if meta.get("format") != "voicewire.voice" or meta.get("version") != FORMAT_VERSION:
            raise ValueError("not a voicewire voice file of a known version")
        return cls(name=meta["name"], consent=meta["consent"], created_at=int(meta["created_at"]),
                   sample_rate=int(meta["sample_rate"]), duration_s=float(meta["duration_s"]),
                   file_size=int(meta["file_size"]), mime_type=known_mime_type(meta["mime_type"]),
                   ref_text=meta.get("ref_text"), speaker_description=meta.get("speaker_description"),
                   imported_from=meta.get("imported_from"))


def known_mime_type(mime_type: str) -> str:
    """`mime_type` if it is one the decoder detects, else `application/octet-stream`."""
    return mime_type if mime_type in _MIME_TYPES else _UNKNOWN_MIME


def default_voices_dir() -> Path:
    """`$XDG_DATA_HOME/voicewire/voices`, or `~/.local/share/voicewire/voices`."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "voicewire" / "voices"


def check_name(name: str, reserved: Collection[str]) -> None:
    """Raise `VoiceStoreError` (400, param `name`) unless `name` is a safe, free voice name."""
    if not NAME_PATTERN.fullmatch(name):
        raise VoiceStoreError(400, "invalid_voice_name",
                              f"invalid voice name {echo(name)}: use 1-64 letters, digits, '_' or '-', "
                              "starting with a letter or digit", "name")
    if name.lower() in {r.lower() for r in reserved}:
        raise VoiceStoreError(400, "voice_name_taken",
                              f"voice name {echo(name)} is a built-in voice or alias; choose another name", "name")


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


@dataclass(frozen=True, slots=True)
class _Cached:
    """A voice's record and the (inode, mtime, size) of the file it was read from."""

    record: VoiceRecord
    version: tuple[int, int, int]


class VoiceStore:
    """The uploaded voices of one server (see the module docstring for the on-disk contract)."""

    def __init__(self, directory: Path, *, max_voices: int, max_upload_bytes: int) -> None:
        self.directory = directory
        self.max_voices = max_voices
        self.max_upload_bytes = max_upload_bytes
        self._voices: dict[str, _Cached] = {}
        self._lock = asyncio.Lock()

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __len__(self) -> int:
        return len(self.records())

    def get(self, name: str) -> VoiceRecord | None:
        """The voice of that name as the directory holds it now (one `stat`; the header is read only when
        the file is new or changed), or else a known voice whose name differs only in case, or None."""
        if not NAME_PATTERN.fullmatch(name):
            return None
        record = self._refresh(name)
        if record is not None:
            return record
        folded = name.lower()
        for known in sorted(self._voices):
            if known.lower() == folded and known != name:
                return self._refresh(known)
        return None

    def records(self) -> list[VoiceRecord]:
        """Every voice in the directory now, by name."""
        try:
            names = [p.stem for p in self.directory.iterdir()
                     if p.suffix == _SUFFIX and not p.name.startswith(".")]
        except FileNotFoundError:
            names = []
        for gone in set(self._voices) - set(names):
            del self._voices[gone]
        found = (self.get(name) for name in sorted(names))
        return [record for record in found if record is not None]

    async def restore(self) -> None:
        """Register every valid voice file in the directory; delete temporaries of interrupted uploads (under
        the lock, so never one of this server's writes in progress)."""
        async with self._lock:
            await asyncio.to_thread(self._scan)
        log.info("voice store %s: %d voices", self.directory, len(self._voices))

    def _scan(self) -> None:
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):
            if path.name.startswith(".") and path.name.endswith(_TMP_SUFFIX):
                log.warning("removing %s, left by an interrupted upload", path)
                path.unlink(missing_ok=True)
        self.records()

    def _refresh(self, name: str) -> VoiceRecord | None:
        path = self._path(name)
        try:
            stat = path.stat()
        except FileNotFoundError:
            self._voices.pop(name, None)
            return None
        version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        cached = self._voices.get(name)
        if cached is not None and cached.version == version:
            return cached.record
        try:
            with safe_open(str(path), framework="numpy") as f:
                record = VoiceRecord.from_header(dict(f.metadata() or {}))
        except FileNotFoundError:
            self._voices.pop(name, None)
            return None
        except Exception as exc:
            log.warning("skipping %s: not a readable voice file (%s)", path, exc)
            self._voices.pop(name, None)
            return None
        if record.name != name:
            log.warning("skipping %s: its name does not match the file name", path)
            return None
        self._voices[name] = _Cached(record, version)
        return record

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
            # Strictly later than every stored voice, the one replaced included (several uploads a second):
            # a cache keyed by name and created_at, as vllm-omni's model-side voice caches are, never
            # serves a replaced voice.
            newest = max((r.created_at for r in self.records()), default=0)
            record = dataclasses.replace(record, created_at=max(record.created_at, newest + 1))
            await self._put(record, audio)
        return record

    async def put_imported(self, record: VoiceRecord, audio: FloatAudio) -> None:
        """Store a voice prepared and validated elsewhere (`realtime.voice_import`) as it is, `created_at`
        included, replacing one whose name differs only in case. Same atomic write as `add`; raises
        `VoiceStoreError` (the voice cap, a full disk) with nothing stored."""
        async with self._lock:
            await self._put(record, audio)

    async def _put(self, record: VoiceRecord, audio: FloatAudio) -> None:
        """Under the lock: check the cap, write the file, drop a voice of the same name in another case."""
        replaced = self.get(record.name)
        if replaced is None and len(self) >= self.max_voices:
            raise VoiceStoreError(400, "too_many_voices",
                                  f"the server keeps at most {self.max_voices} voices; delete one first", "name")
        await asyncio.to_thread(self._write, record, audio)
        if replaced is not None and replaced.name != record.name:
            await asyncio.to_thread(self._drop_other_spelling, replaced.name, record.name)
            self._voices.pop(replaced.name, None)
        self._refresh(record.name)

    async def remove(self, name: str) -> None:
        """Delete a voice; raises `VoiceStoreError` (404) when there is none of that name."""
        async with self._lock:
            record = self.get(name)
            if record is None:
                raise VoiceStoreError(404, "voice_not_found", f"voice {echo(name)} not found", "name")
            await asyncio.to_thread(self._unlink, self._path(record.name))
            self._voices.pop(record.name, None)

    def load_audio(self, name: str) -> tuple[FloatAudio, int]:
        """The stored samples and rate of a voice (blocking disk read; for cloning engines). Raises KeyError
        when the voice is gone."""
        record = self.get(name)
        if record is None:
            raise KeyError(name)
        with safe_open(str(self._path(record.name)), framework="numpy") as f:
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

    def _drop_other_spelling(self, old: str, new: str) -> None:
        """Delete the file of voice `old`, just replaced by `new` (the same name in another case), unless
        it is the file just written (a file system that folds case)."""
        path = self._path(old)
        with contextlib.suppress(FileNotFoundError):
            if not path.samefile(self._path(new)):
                self._unlink(path)

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
