"""Heavy audio work off the event loop that every session shares (issue 14 #14).

Time-stretching, resampling, compressed encoding (mp3, Opus, AAC, FLAC) and base64/JSON of whole files
cost milliseconds to seconds of CPU per call; on the loop they delay every other session's audio and
`/health`. `AudioThreads.run` runs such a call on a small pool of threads of its own (not the loop's
default executor, which engine worker pipes block on) and awaits it. NumPy and FFmpeg release the GIL
for most of that work; where they do not, the interpreter still hands the loop the GIL every switch
interval, so one call never holds the loop for its whole length.

Cancellation: a thread cannot be stopped, and the objects it works on (a unit's renderer, an encoder)
are closed by whoever cancelled. So `run` cancelled while its call is still running waits for the call
to end before it raises `CancelledError`: nothing is closed under a running call. A call is one piece or
one file, bounded by the unit and response audio bounds.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar, TypeVarTuple

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

AUDIO_THREADS: Final = min(4, os.cpu_count() or 1)
"""Threads of the pool: more than the cores would only contend for them."""


class AudioThreads:
    """The server's pool for heavy audio work; one per server, `close()` at shutdown."""

    def __init__(self, threads: int = AUDIO_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="voicewire-audio")

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """`fn(*args)` on a pool thread; its result or its exception. Cancelled, it raises only once the
        call has ended (see the module docstring)."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():
                try:
                    await asyncio.wait([future])
                except asyncio.CancelledError:
                    continue
            if not future.cancelled():
                future.exception()  # retrieved: a failure of an abandoned call is not reported again
            raise

    async def run_if(self, costly: bool, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """`run(fn, *args)` when `costly`, else `fn(*args)` right here (a thread hop costs more than a
        cheap call)."""
        return await self.run(fn, *args) if costly else fn(*args)

    def close(self) -> None:
        """Stop the threads once their calls end; calls not started are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
