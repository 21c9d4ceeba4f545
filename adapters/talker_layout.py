"""The Orpheus token layout: how a Llama talker's vocabulary carries SNAC 24 kHz codes.

Pure (no torch, no vLLM, no I/O): prompt token ids in, codec frames out.

Orpheus (canopylabs' 3B Llama talker) appends its own tokens to the Llama-3 vocabulary (128256 ids):
`<custom_token_N>` is id `128256 + N`. The ones used here:

- prompt: `[START_OF_HUMAN] + tokenize(f"{voice}: {text}") + [END_OF_TEXT, END_OF_HUMAN, START_OF_AI,
  START_OF_SPEECH]` (the tokenizer adds `<|begin_of_text|>` itself), exactly as Orpheus' own engine;
- audio: after `START_OF_SPEECH` the talker emits 7 code tokens per frame; the token at position `i` of
  a frame (`slot = i % 7`) is `AUDIO_BASE + slot * 4096 + code` with `code` in `[0, 4096)`;
- stop: `END_OF_SPEECH` (or `END_OF_AI`, `END_OF_TEXT`) ends the audio.

A frame's 7 codes map to SNAC's three levels (12, 23 and 47 Hz at 24 kHz) as
`level0 = [c0]`, `level1 = [c1, c4]`, `level2 = [c2, c3, c5, c6]`; one frame is 2048 samples (85.3 ms).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

CodeFrames = npt.NDArray[np.int64]
"""Codec frames, shape (frames, 7), in the talker's emission order (c0..c6 of each frame)."""

CODES_PER_FRAME = 7
CODEBOOK_SIZE = 4096
SAMPLES_PER_FRAME = 2048
SAMPLE_RATE = 24000

START_OF_SPEECH = 128257
END_OF_SPEECH = 128258
START_OF_HUMAN = 128259
END_OF_HUMAN = 128260
START_OF_AI = 128261
END_OF_AI = 128262
END_OF_TEXT = 128009
AUDIO_BASE = 128266
"""`<custom_token_10>`: code 0 of slot 0."""
AUDIO_END = AUDIO_BASE + CODES_PER_FRAME * CODEBOOK_SIZE
"""One past the last audio token id (`<custom_token_28682>`); Orpheus' vocabulary holds 156940 ids."""
STOP_TOKEN_IDS = (END_OF_SPEECH, END_OF_AI, END_OF_TEXT)
PROMPT_SUFFIX = (END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH)
ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
"""The voices of Orpheus' English finetune, in its recommended order (tara first)."""


def build_prompt(prefix_ids: Sequence[int], text_ids: Sequence[int]) -> list[int]:
    """A unit's prompt: the voice's conditioning prefix (may be empty), then Orpheus' human turn holding
    the tokenized `"{voice}: {text}"` (or just the text), then the AI turn's opening up to start-of-speech."""
    return [*prefix_ids, START_OF_HUMAN, *text_ids, *PROMPT_SUFFIX]


@dataclass(slots=True)
class FrameParser:
    """Turns the talker's streamed token ids into complete codec frames.

    Feed token ids in order with `feed`; it returns the frames completed by them. Audio-range tokens fill
    the current frame's next slot; a token whose value belongs to another slot (a real Orpheus talker
    almost never emits one; random weights do all the time) is folded into range (`code % 4096`) and
    counted in `slot_mismatches`. A stop token ends the stream (`stopped`); any other token is skipped
    and counted in `skipped`. With `any_token_is_code` (random-weight mode, whose talker emits arbitrary
    ids) every token is a code, `token % 4096`. An incomplete last frame is never returned. Memory: at most
    6 pending codes.
    """

    any_token_is_code: bool = False
    slot_mismatches: int = 0
    skipped: int = 0
    stopped: bool = False
    _pending: list[int] = field(default_factory=list)

    def feed(self, token_ids: Iterable[int]) -> CodeFrames:
        frames: list[list[int]] = []
        for token in token_ids:
            if self.stopped:
                break
            if self.any_token_is_code:
                self._pending.append(token % CODEBOOK_SIZE)
                if len(self._pending) == CODES_PER_FRAME:
                    frames.append(self._pending)
                    self._pending = []
            elif AUDIO_BASE <= token < AUDIO_END:
                slot = len(self._pending)
                code = token - AUDIO_BASE - slot * CODEBOOK_SIZE
                if not 0 <= code < CODEBOOK_SIZE:
                    self.slot_mismatches += 1
                    code %= CODEBOOK_SIZE
                self._pending.append(code)
                if len(self._pending) == CODES_PER_FRAME:
                    frames.append(self._pending)
                    self._pending = []
            elif token in STOP_TOKEN_IDS:
                self.stopped = True
            else:
                self.skipped += 1
        return np.asarray(frames, np.int64).reshape(-1, CODES_PER_FRAME)
