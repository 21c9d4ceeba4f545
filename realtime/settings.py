"""Server settings: every limit the server publishes and enforces, with its default.

Settings come from `voicewire serve` flags (see `cli.py`) or are built directly by tests and embedders.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

OPENAI_VOICE_NAMES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
                      "shimmer", "verse", "marin", "cedar")
OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
SERVER_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "hibari"
    engine_workers: int = 1
    """Engine requests computed at once (hibari: worker processes or threads, one core each)."""
    engine_isolation: Literal["process", "thread"] = "process"
    """hibari in child processes (a crashed worker is restarted, only its units fail) or in threads."""
    engine_processes: int | None = None
    """With process isolation: the child processes the `engine_workers` threads are spread over, evenly
    (None: one process per worker). Fewer processes load fewer copies of the engine (a thread in an existing
    process takes about 200 MiB less than a process of its own, docs/operations.md); a crash then fails the
    units of every thread of its process."""

    max_sessions: int = 64
    """WebSocket sessions at once; one more is refused with close code 1013."""
    admission_utilization: float = 0.8
    """Capacity admission: a new WebSocket session is refused (close 1013) while the sessions speaking now
    would need more than this share of the engine's measured capacity; 0 turns it off (`max_sessions` only)."""
    config_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    """No client message and no audio in progress for this long closes the session."""
    stall_timeout_s: float = 15.0
    """A send blocked this long (the client stopped reading) closes the session with 1008."""
    max_config_bytes: int = 4 * 1024 * 1024
    max_message_bytes: int = 128 * 1024
    """Largest text frame other than session.config."""
    max_utterance_chars: int = 100_000
    max_unit_chars: int = 250
    max_units_in_flight: int = 2
    """Units per session synthesizing or synthesized-but-unsent; bounds a slow client's memory."""
    unit_timeout_s: float = 60.0
    """Engine time one unit may take; past it the unit is cancelled with a `unit_timeout` error."""
    max_unit_audio_s: float = 120.0
    """Audio one unit may produce (at the requested speed); past it the unit is stopped with a
    `unit_too_long` error. A unit of `max_unit_chars` at speed 0.25 is estimated at 65 s."""
    max_response_audio_s: float = 300.0
    """Audio one non-streamed REST response may hold (a whole file, or all of a batch's items): more by
    estimate is refused before synthesis, and a response that runs past it anyway is stopped (400
    `audio_too_long`; streamed responses are not held, so not bounded by this)."""
    max_pending_events: int = 256
    """Control events queued for a client that is not reading; past this the session is closed."""
    resume_window_s: float = 30.0
    """How long a resumable session (its client sent `session.ack`) whose connection dropped without
    `session.close` waits for `session.resume`; 0: disconnect ends every session, as it always did."""
    replay_buffer_bytes: int = 1024 * 1024
    """Server frames kept per session for a resume (about 20 s of 24 kHz pcm16); past it a resumable
    session pauses its synthesis until the client acknowledges or resumes. With `max_sessions` this bounds
    the memory replay takes: `max_sessions` x this."""
    shutdown_grace_s: float = 10.0
    server_id: str | None = None
    """This server's name behind a load balancer (1-64 letters, digits, '_' or '-'). Session ids start with
    it (`<server_id>.sess_000003`), so a balancer routes a resume (`?session_id=`) to the server that holds
    the session (`deploy/haproxy.cfg`); None: ids are `sess_000003`."""
    api_keys: tuple[str, ...] = ()
    api_keys_file: Path | None = None
    """One key per line; re-read on SIGHUP and when it changes."""
    allow_unauthenticated: bool = False
    """Run with no API keys at all (development only; logged as a warning)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins (besides the server's own) that may open WebSockets; "*" allows any."""
    max_sessions_per_key: int = 32
    max_sessions_per_ip: int = 32
    rest_requests_per_minute: float = 600.0
    rest_burst: float = 60.0
    header_timeout_s: float = 15.0
    """A connection must send a request's complete headers within this of opening or of its previous
    response; it is also how long an idle keep-alive connection is kept. Past it the connection is closed."""
    body_timeout_s: float = 60.0
    """A request's body must have arrived this long after its headers: 408 and the connection closed."""
    max_bodies_per_ip: int = 16
    """Requests from one address whose head or body is still arriving; one more is refused with 429."""
    trust_forwarded_for: bool = False
    """Take the client address from X-Forwarded-For (only behind a proxy that sets it)."""
    voice_aliases: dict[str, str] = field(default_factory=dict)
    """Extra voice names (OpenAI's by default) mapped onto engine voices; filled in by the app."""
    model_aliases: tuple[str, ...] = OPENAI_MODEL_NAMES
    max_input_chars: int = 4096
    """Longest `input` of one REST speech request (OpenAI's limit)."""
    max_rest_requests: int = 64
    """REST speech requests synthesizing at once; one more is refused with 503."""
    batch_max_items: int = 32
    """Items of one `POST /v1/audio/speech/batch` request."""
    voices_dir: Path | None = None
    """Where uploaded voices are stored; None: `$XDG_DATA_HOME/voicewire/voices` (~/.local/share/...)."""
    import_vllm_omni_voices: Path | None = None
    """A voice directory written by vllm-omni's speech server (its `$SPEAKER_SAMPLES_DIR`), imported into
    the voice store at every start (`realtime.voice_import`); None: no import."""
    max_voices: int = 1000
    """Uploaded voices kept; an upload past the cap is refused (400)."""
    max_voice_upload_bytes: int = 10 * 1024 * 1024
    """Largest voice sample upload (413 past it)."""

    def __post_init__(self) -> None:
        if self.server_id is not None and not SERVER_ID_PATTERN.fullmatch(self.server_id):
            raise ValueError(f"server id {self.server_id!r}: use 1-64 letters, digits, '_' or '-'")
