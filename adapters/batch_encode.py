"""Text to token ids off the event loop, in batches: what a burst of sessions asks for in one turn of the loop
is encoded by one call on a worker thread.

A `tokenizers.Tokenizer`'s `encode` runs on the calling thread with the GIL held (about 0.1 ms for a
sentence of 130 bytes on the 2-core development machine), so a burst of sessions that each encode their unit
on the server's loop queue behind one another's tokenizing. Its `encode_batch` releases the GIL and spreads
the texts over its own threads. `BatchEncoder.encode` queues a text and awaits its ids; the texts queued
before the loop next runs its ready callbacks go to the worker thread together, one batch at a time (a text
queued while a batch runs waits for that batch, then goes with the next).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from typing import Any, Protocol


class BatchTokenizer(Protocol):
    """What `BatchEncoder` needs of a tokenizer (`tokenizers.Tokenizer` has it): per text, an encoding whose
    `ids` are its token ids, in the order of `texts`."""

    def encode_batch(self, texts: Sequence[str]) -> Sequence[Any]: ...


class BatchEncoder:
    """Encodes texts with `tokenizer` on one worker thread of its own, batching those queued together.

    `encode` must be awaited on one event loop (the one that owns the encoder). A tokenizer error fails every
    text of its batch with that error; a caller that stops waiting (cancelled) leaves the others' results
    intact. `close` stops the thread once the batch running has finished; `encode` after it raises
    RuntimeError."""

    def __init__(self, tokenizer: BatchTokenizer) -> None:
        self._tokenizer = tokenizer
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="voicewire-tokenize")
        self._queued: list[tuple[str, asyncio.Future[list[int]]]] = []
        self._running = False
        self._closed = False

    async def encode(self, text: str) -> list[int]:
        """`text`'s token ids, as `tokenizer.encode_batch([text])[0].ids` gives them."""
        if self._closed:
            raise RuntimeError("BatchEncoder: closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        self._queued.append((text, future))
        if len(self._queued) == 1 and not self._running:
            loop.call_soon(self._next_batch, loop)
        return await future

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=False)

    def _next_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._queued = [(text, f) for text, f in self._queued if not f.done()], []
        if not batch or self._closed:
            for _, future in batch:
                future.set_exception(RuntimeError("BatchEncoder: closed"))
            return
        self._running = True
        job = loop.run_in_executor(self._executor, self._encode, [text for text, _ in batch])
        job.add_done_callback(lambda done: self._deliver(loop, batch, done))

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [list(encoding.ids) for encoding in self._tokenizer.encode_batch(texts)]

    def _deliver(self, loop: asyncio.AbstractEventLoop, batch: list[tuple[str, asyncio.Future[list[int]]]],
                 done: asyncio.Future[list[list[int]]]) -> None:
        self._running = False
        error = done.exception() if not done.cancelled() else RuntimeError("BatchEncoder: closed")
        for index, (_, future) in enumerate(batch):
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result()[index])
        if self._queued:
            self._next_batch(loop)
