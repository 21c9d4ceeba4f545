"""`BatchEncoder` with a real `tokenizers` BPE tokenizer trained here on a few sentences: texts asked for
together come back as the tokenizer's own `encode` gives them, in fewer calls than texts; a failing batch
fails each of its texts and the next batch runs; a caller that stops waiting leaves the others' ids intact;
a closed encoder refuses new texts."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from voicewire.adapters.batch_encode import BatchEncoder

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Speech streams out as soon as words can be spoken.",
          "tara: Hello there, how are you today?", "Numbers like 1,234.5 and dates like 2026-12-06 stay text."]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return bpe


class Counted:
    """The real tokenizer, counting its batch calls and failing those that contain `poison`."""

    def __init__(self, tokenizer: Tokenizer, poison: str = "") -> None:
        self.tokenizer = tokenizer
        self.poison = poison
        self.batches: list[int] = []

    def encode_batch(self, texts: Sequence[str]) -> Sequence[Any]:
        self.batches.append(len(texts))
        if self.poison and self.poison in texts:
            raise ValueError(f"cannot encode {self.poison!r}")
        return self.tokenizer.encode_batch(list(texts))


async def test_texts_asked_for_together_are_encoded_as_the_tokenizer_encodes_them(tokenizer: Tokenizer) -> None:
    counted = Counted(tokenizer)
    encoder = BatchEncoder(counted)
    texts = [f"{CORPUS[i % len(CORPUS)]} Unit {i}." for i in range(64)]
    try:
        got = await asyncio.gather(*(encoder.encode(text) for text in texts))
        assert got == [tokenizer.encode(text).ids for text in texts]
        assert all(got) and sum(counted.batches) == len(texts) and len(counted.batches) < len(texts) / 4
        # One at a time still works: each its own batch.
        assert await encoder.encode(texts[0]) == got[0]
    finally:
        encoder.close()


async def test_a_failing_batch_fails_each_of_its_texts_and_the_next_batch_runs(tokenizer: Tokenizer) -> None:
    counted = Counted(tokenizer, poison="poison")
    encoder = BatchEncoder(counted)
    try:
        got = await asyncio.gather(encoder.encode("fine"), encoder.encode("poison"), return_exceptions=True)
        assert all(isinstance(result, ValueError) and "poison" in str(result) for result in got), got
        assert await encoder.encode(CORPUS[0]) == tokenizer.encode(CORPUS[0]).ids
    finally:
        encoder.close()


async def test_a_caller_that_stops_waiting_leaves_the_others_intact(tokenizer: Tokenizer) -> None:
    encoder = BatchEncoder(Counted(tokenizer))
    try:
        gone = asyncio.ensure_future(encoder.encode(CORPUS[1]))
        kept = [asyncio.ensure_future(encoder.encode(text)) for text in CORPUS]
        await asyncio.sleep(0)
        gone.cancel()
        assert await asyncio.gather(*kept) == [tokenizer.encode(text).ids for text in CORPUS]
        assert gone.cancelled()
    finally:
        encoder.close()


async def test_a_closed_encoder_refuses_new_texts(tokenizer: Tokenizer) -> None:
    encoder = BatchEncoder(Counted(tokenizer))
    assert await encoder.encode(CORPUS[2]) == tokenizer.encode(CORPUS[2]).ids
    encoder.close()
    with pytest.raises(RuntimeError, match="closed"):
        await encoder.encode(CORPUS[2])
