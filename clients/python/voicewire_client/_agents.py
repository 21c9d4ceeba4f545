"""What the Pipecat and LiveKit integrations share (neither framework is imported here).

Both own the audio fields of `session.config` (they decode pcm16 binary frames), keep each utterance's
text as it was sent, and turn the server's word spans back into the words as sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from voicewire_client.events import WordTiming

OWNED_FIELDS: Final = frozenset({"response_format", "stream_audio", "audio_frames", "sample_rate", "word_timestamps"})
"""`session.config` fields the integrations set themselves."""


def refuse_owned_fields(session_config: Iterable[str] | None, why: str) -> None:
    """Raise `ValueError` when `session_config` sets a field the integration owns; `why` says what it does."""
    refused = OWNED_FIELDS & set(session_config or ())
    if refused:
        raise ValueError(f"session_config may not set {', '.join(sorted(refused))}: {why}")


@dataclass(slots=True)
class Utterance:
    """One utterance on a session: its index there, its context id and the text sent so far (`text()`)."""

    index: int
    context_id: str
    parts: list[str] = field(default_factory=list)

    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


def word_end(text: str, word: WordTiming) -> int:
    """Where the word ends in `text` as it was sent: its span plus the punctuation glued to its end."""
    end = word.char_end
    while end < len(text) and not text[end].isspace():
        end += 1
    return end
