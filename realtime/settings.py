"""Server settings: every limit the server publishes and enforces, with its default.

Settings come from `voicewire serve` flags (see `cli.py`) or are built directly by tests and embedders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPENAI_VOICE_NAMES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
                      "shimmer", "verse", "marin", "cedar")
OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "hibari"
    engine_workers: int = 1
    """Engine requests computed at once (hibari: worker threads, one core each)."""

    max_sessions: int = 64
    """WebSocket sessions at once; one more is refused with close code 1013."""
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
    max_pending_events: int = 256
    """Control events queued for a client that is not reading; past this the session is closed."""
    shutdown_grace_s: float = 10.0
    voice_aliases: dict[str, str] = field(default_factory=dict)
    """Extra voice names (OpenAI's by default) mapped onto engine voices; filled in by the app."""
    model_aliases: tuple[str, ...] = OPENAI_MODEL_NAMES
