"""An event loop on a thread of its own, for an engine's frontend that would otherwise run on the server's loop.

vLLM's `AsyncLLM` does real work on the loop it lives on: each request's input processing when it is
added, and an output handler that turns every engine step into one output per running request. On the
server's loop that work delays every session's reads and writes: at 64 talker sessions starting together,
handing their requests to vLLM took 15-25 ms of the loop on the CPU (`TalkerEngine.frontend_seconds`), the
size of the whole gap the H200 measured between a client's `input.done` and the engine call.
`LoopThread` runs such an object on its own loop; the server's loop only posts coroutines to it and
receives what they yield.

Contracts:
- `call(fn, *args)` runs the coroutine function on the thread's loop and returns its result (or raises its
  exception) on the caller's loop.
- `stream(fn, *args)` iterates the async iterator that `fn(*args)` returns on the thread's loop and yields
  its items, in order, on the caller's loop. Items are delivered in batches: however many are ready, one
  wake-up of the caller's loop (`call_soon_threadsafe`) carries them all. Closing the stream early (or
  cancelling its consumer) cancels the producing task on the thread's loop and waits until it has finished
  (its `finally` blocks, an abort included, have run) before the close returns.
- One caller loop per `LoopThread`: the loop that first calls `stream` or `call` (`RuntimeError` from
  another).
- `stop()` ends the loop and joins the thread; tasks still on it are cancelled first.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

_ITEM, _END, _ERROR = 0, 1, 2


class _Producer:
    """One stream's producing task on the thread's loop, and whether its consumer asked it to stop before it
    had started (both only read and written on the thread's loop)."""

    __slots__ = ("cancelled", "task")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.cancelled = False

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
        else:
            self.cancelled = True


class LoopThread:
    """An event loop running on a daemon thread named `name` (see the module doc)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._home: asyncio.AbstractEventLoop | None = None
        self._pending: deque[tuple[asyncio.Queue[tuple[int, Any]], tuple[int, Any]]] = deque()
        self._wake_scheduled = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _caller(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._home is None:
            self._home = loop
        elif self._home is not loop:
            raise RuntimeError(f"{self._thread.name}: used from a second event loop")
        return loop

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await fn(*args)` on the thread's loop; its result or exception here."""
        self._caller()

        async def run() -> T:
            return await fn(*args)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))

    async def stream(self, fn: Callable[..., AsyncIterator[T]], *args: Any) -> AsyncGenerator[T]:
        """The items of `fn(*args)`, produced on the thread's loop, yielded here in order."""
        home = self._caller()
        inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        producer = _Producer()

        async def produce() -> None:
            if producer.cancelled:
                self._post(home, inbox, (_END, None))
                return
            producer.task = asyncio.current_task()
            outcome: tuple[int, Any] = (_END, None)
            items = fn(*args)
            try:
                async for item in items:
                    self._post(home, inbox, (_ITEM, item))
            except asyncio.CancelledError:  # its consumer left (it reads no further), or stop()
                outcome = (_ERROR, RuntimeError(f"{self._thread.name}: stopped"))
            except Exception as exc:
                outcome = (_ERROR, exc)
            finally:
                aclose = getattr(items, "aclose", None)
                try:
                    if aclose is not None:
                        await aclose()
                finally:
                    self._post(home, inbox, outcome)

        asyncio.run_coroutine_threadsafe(produce(), self.loop)
        ended = False
        try:
            while True:
                kind, value = await inbox.get()
                if kind == _ITEM:
                    yield value
                    continue
                ended = True
                if kind == _ERROR:
                    raise value
                return
        finally:
            if not ended:
                self.loop.call_soon_threadsafe(producer.cancel)
                while (await inbox.get())[0] == _ITEM:
                    pass

    def _post(self, home: asyncio.AbstractEventLoop, inbox: asyncio.Queue[tuple[int, Any]],
              message: tuple[int, Any]) -> None:
        """On the thread's loop: queue `message` for `inbox`; the first message since the last delivery
        schedules one delivery on the caller's loop. Appending before reading the flag here, and clearing
        the flag before draining there, means no message is left behind."""
        self._pending.append((inbox, message))
        if not self._wake_scheduled:
            self._wake_scheduled = True
            home.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        """On the caller's loop: hand every queued message to its stream."""
        self._wake_scheduled = False
        pending = self._pending
        while pending:
            inbox, message = pending.popleft()
            inbox.put_nowait(message)

    def stop(self) -> None:
        """Cancel what still runs on the thread's loop, stop it and join the thread (idempotent)."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()
