"""Text shaped like an LLM's output, for the voice-agent integration tests."""

from __future__ import annotations

REPLY = "Sure, I can help with that. The store opens at nine tomorrow. Bring your receipt, please."
LONG_REPLY = " ".join(["This is a long answer that keeps going for a while so it can be interrupted."] * 6)


def llm_tokens(text: str) -> list[str]:
    """Cut text into LLM-like deltas: a word or a fragment of one, with its leading space."""
    tokens: list[str] = []
    for i, word in enumerate(text.split(" ")):
        piece = word if i == 0 else " " + word
        tokens.extend([piece[:3], piece[3:]] if len(piece) > 5 else [piece])
    return [t for t in tokens if t]
