"""Process isolation for CPU engines: each worker is a child process running its own engine.

`ProcessEngine` implements the engine interface by dispatching every request to one of `workers` child
processes (spawned, never forked), each running its own engine (by default `create_engine(name,
workers=threads)`, one thread) on its own event loop. Requests go down a pipe, audio pieces stream back as
they are computed; every message on the pipe is one of the typed structs below (`ToWorker`, `FromWorker`) in
MessagePack (msgspec: a tenth of pickle's CPU on each side), but for a `Piece`'s samples, which follow it
raw. On each side one thread reads the pipe, decodes and hands each message to the event loop
(`call_soon_threadsafe`): no executor hop per message.

Why processes: an engine crash (a native fault, the OOM killer, `kill -9`) takes one worker down, not
the server. When a worker dies, only the requests it was computing fail (with `EngineWorkerDied`); requests
not yet sent to a worker never fail for it. Python code in engines (G2P, DSP glue) also stops competing with
the server's event loop for the GIL.

Supervision: each worker slot has one supervisor task, which owns at most one process at a time. It spawns
a worker, waits until it is warm, waits for it to end, reaps it (killed if still running, joined, its pipe
and sentinel closed) and only then spawns the next. So the pool never holds more than `workers` processes
and leaks no descriptor, whatever sequence of deaths happens (a worker killed while it starts included).
The first death after a stable run (`WorkerTimings.stable_s`) is restarted at once; each further death in
a row waits twice as long as the one before (`backoff_s` doubling up to `backoff_max_s`), so an engine
that cannot stay up is not respawned in a tight loop. `health` reports each slot's state and its deaths in
a row; the server publishes it in `/ready` and `/metrics`.

Waiting: a request waits for a live worker with a free slot (a worker computes at most its engine's
`max_concurrency` requests, counting cancelled ones it has not yet confirmed stopped); the caller's deadline
(the unit timeout) bounds the wait. So while workers are being replaced, units queue instead of failing.

Liveness: a worker's event loop sends a heartbeat every `heartbeat_s`. A worker not heard from for
`hang_s` (stopped with SIGSTOP, a blocked loop, a wedged native call) is killed and replaced; only the
requests it had in flight fail.

Cancel: closing a request's iterator sends a cancel to its worker, which closes the engine request there
(for hibari that terminates the onnxruntime run) and confirms once the request has ended and, when nothing
else runs in the worker, its threads are quiet: no thread but the event loop used CPU in two short windows
in a row. That catches a stage the engine cannot interrupt and leaves running on a thread after its
iterator closed (text processing, for one). A worker that has not confirmed a cancel within
`cancel_grace_s` is killed and replaced, so no core stays busy on abandoned work after a unit's deadline.

Memory per request in the parent: the pieces received but not yet consumed, bounded by one unit's audio;
in the worker: the pieces computed but not yet written to the pipe (one thread writes them, in order, so
the worker's event loop never waits for the pipe), bounded the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from queue import SimpleQueue
from typing import Literal

import msgspec
import numpy as np
from voicewire.adapters.base import Engine, RequestCounts
from voicewire.protocol.engine import (
    NO_TOKENS,
    AudioPiece,
    EngineError,
    EngineInfo,
    EngineWorkerLost,
    FloatAudio,
    SynthesisRequest,
    TokenCounts,
    WordSpan,
    failure_of,
)

log = logging.getLogger("voicewire.workers")

STOP_GRACE_S = 5.0
"""On close, how long a worker may take to stop its engine before it is killed."""
QUIET_WINDOW_S = 0.025
QUIET_WINDOWS = 2
QUIET_CPU_S = 0.001
"""A worker's threads are quiet when, besides its event loop, they used less than `QUIET_CPU_S` of CPU in
each of `QUIET_WINDOWS` windows of `QUIET_WINDOW_S` in a row (a thread blocked on a queue uses none)."""


class EngineWorkerDied(EngineWorkerLost):
    """The worker process computing this request exited or was replaced; the request is lost, the server is
    not."""


class EngineWorkerError(EngineError):
    """The engine in a worker raised; the message is the worker's exception text and `code` the code
    `failure_of` gave that exception in the worker, so a unit fails with the same code in a worker as
    in-process."""

    def __init__(self, reason: str, code: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True, slots=True)
class WorkerTimings:
    """How the pool supervises its workers (see the module docstring)."""

    start_timeout_s: float = 120.0
    """A worker not warm within this is killed (and counts as a death)."""
    heartbeat_s: float = 1.0
    hang_s: float = 10.0
    """A live worker not heard from for this long is killed and replaced."""
    cancel_grace_s: float = 3.0
    """A worker that has not confirmed a cancel within this is killed and replaced."""
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_s: float = 30.0
    """A worker live this long resets its slot's deaths in a row."""


@dataclass(frozen=True, slots=True)
class WorkerStats(RequestCounts):
    """Requests by outcome (`RequestCounts`), across all workers; `confirmed`: cancels a worker confirmed
    stopped (the rest of `cancelled` went with a worker that died or was replaced, or are still unconfirmed);
    `restarts`: workers started to replace one that died or was killed."""

    confirmed: int = 0
    restarts: int = 0


SlotState = Literal["starting", "live", "backoff"]
"""`starting`: a process is loading and warming its engine; `live`: it takes requests; `backoff`: its last
process died and the next one starts after the back-off delay."""
SLOT_STATES: tuple[SlotState, ...] = ("starting", "live", "backoff")


@dataclass(frozen=True, slots=True)
class SlotHealth:
    """One worker slot: its state, the process id of its current process (None in back-off), and how many
    of its processes died in a row (reset once one has been live for `WorkerTimings.stable_s`)."""

    state: SlotState
    pid: int | None
    failures: int


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """The pool at one instant: every slot, requests waiting for a live worker, restarts so far."""

    slots: tuple[SlotHealth, ...]
    waiting: int
    restarts: int

    @property
    def live(self) -> int:
        return sum(1 for s in self.slots if s.state == "live")

    def counts(self) -> dict[str, int]:
        """Slots per state, every state present (zero included)."""
        return {state: sum(1 for s in self.slots if s.state == state) for state in SLOT_STATES}


def pool_health(engine: object) -> PoolHealth | None:
    """The worker pool's health when `engine` runs in worker processes; None for an in-process engine."""
    return engine.health if isinstance(engine, ProcessEngine) else None


# -- the pipe's messages -------------------------------------------------------------------------------


class Synth(msgspec.Struct, frozen=True, tag=True):
    """Parent to worker: compute `request`; its messages back carry `rid`."""

    rid: str
    request: SynthesisRequest


class Cancel(msgspec.Struct, frozen=True, tag=True):
    """Parent to worker: stop request `rid` and confirm with `Cancelled` once its work has stopped."""

    rid: str


class Stop(msgspec.Struct, frozen=True, tag=True):
    """Parent to worker: close the engine and exit."""


ToWorker = Synth | Cancel | Stop


class Ready(msgspec.Struct, frozen=True, tag=True):
    """Worker to parent: the engine is loaded and warm."""

    info: EngineInfo


class StartFailed(msgspec.Struct, frozen=True, tag=True):
    """Worker to parent: the engine could not start; the worker exits."""

    reason: str


class Piece(msgspec.Struct, frozen=True, tag=True):
    """Worker to parent: an audio piece of request `rid`. Its `samples` float32 samples follow as the next
    message on the pipe, raw (`Connection.send_bytes` of the array's buffer): pickling the array and
    unpickling it on the other side made two more copies of every piece and took about twice the CPU of the
    raw transfer on each side."""

    rid: str
    samples: int
    sample_rate: int
    words: tuple[WordSpan, ...]
    tokens: TokenCounts = NO_TOKENS


class Done(msgspec.Struct, frozen=True, tag=True):
    rid: str


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The engine raised for request `rid`; `reason` is the exception's text, `code` its error code
    (`failure_of`: an `EngineError`'s own, else `generation_failed`)."""

    rid: str
    reason: str
    code: str


class Cancelled(msgspec.Struct, frozen=True, tag=True):
    """Request `rid` was cancelled and its work has stopped."""

    rid: str


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """The worker's event loop runs (sent every `WorkerTimings.heartbeat_s`)."""


FromWorker = Ready | StartFailed | Piece | Done | Failed | Cancelled | Heartbeat

_encode = msgspec.msgpack.Encoder().encode
_decode_to_worker = msgspec.msgpack.Decoder(ToWorker).decode
_decode_from_worker = msgspec.msgpack.Decoder(FromWorker).decode


@dataclass(frozen=True, slots=True)
class _Lost:
    """Parent side only: the worker computing the request is gone."""

    reason: str


@dataclass(frozen=True, slots=True)
class _Audio:
    """Parent side only: a `Piece` and its samples, as the reader thread received them."""

    rid: str
    piece: AudioPiece


_Reply = _Audio | Done | Failed | _Lost


@dataclass(eq=False)
class _Worker:
    slot: int
    process: BaseProcess
    """Closed once reaped: read `pid`, which outlives it, not `process.pid`."""
    pid: int | None
    conn: Connection
    ready: asyncio.Future[EngineInfo]
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on the loop once the worker's pipe reached EOF (the process is gone or going)."""
    live: bool = False
    capacity: int = 1
    last_heard: float = field(default_factory=time.monotonic)
    """Written by the reader thread on every message."""
    fate: str = "died"
    """How it ended, for the errors of its in-flight requests ("died", or why it was killed)."""
    inflight: dict[str, asyncio.Queue[_Reply]] = field(default_factory=dict)
    """Requests in flight and their reply queues."""
    cancelling: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    """Cancels sent and not yet confirmed, with the timer that replaces the worker if they never are."""

    @property
    def load(self) -> int:
        return len(self.inflight) + len(self.cancelling)

    def send(self, message: ToWorker) -> None:
        """Send `message` to the worker; raises `OSError` once the pipe is broken. Only the event loop sends
        (the reader thread only receives), so sends need no lock."""
        self.conn.send_bytes(_encode(message))


@dataclass(frozen=True, slots=True)
class _Ended:
    pid: int | None
    exitcode: int | None


@dataclass(eq=False)
class _Slot:
    index: int
    state: SlotState = "starting"
    worker: _Worker | None = None
    failures: int = 0


def _named_engine(name: str, threads: int = 1) -> Engine:
    from voicewire.adapters.registry import create_engine

    return create_engine(name, workers=threads)


class ProcessEngine:
    """The engine `engine_name` in `workers` child processes (see the module docstring).

    `build` makes each worker's engine inside the child (it must pickle: a module-level function or a
    `functools.partial` of one); it defaults to the registry's `engine_name` with `threads` threads, so one
    worker computes up to `threads` requests at once (its engine's `max_concurrency`).
    """

    def __init__(self, engine_name: str, *, workers: int = 1, threads: int = 1,
                 build: Callable[[], Engine] | None = None, timings: WorkerTimings | None = None) -> None:
        if workers < 1 or threads < 1:
            raise ValueError("workers and threads must be >= 1")
        self.engine_name = engine_name
        self.workers = workers
        self.timings = timings or WorkerTimings()
        self._build: Callable[[], Engine] = build or functools.partial(_named_engine, engine_name, threads)
        self._slots = [_Slot(i) for i in range(workers)]
        self._supervisors: list[asyncio.Task[None]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._info: EngineInfo | None = None
        self._ids = itertools.count()
        self._turns = itertools.count()
        self._closing = False
        self._changed = asyncio.Event()
        self._waiting = 0
        self._stats = WorkerStats()
        self._mp = multiprocessing.get_context("spawn")

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("engine not started")
        return self._info

    @property
    def stats(self) -> WorkerStats:
        return self._stats

    @property
    def health(self) -> PoolHealth:
        return PoolHealth(
            slots=tuple(SlotHealth(s.state, s.worker.pid if s.worker is not None else None, s.failures)
                        for s in self._slots),
            waiting=self._waiting, restarts=self._stats.restarts)

    def worker_pids(self) -> list[int | None]:
        """The process id of each live worker (None for a slot whose worker is starting or backing off)."""
        return [w.pid if (w := s.worker) is not None and w.live else None for s in self._slots]

    def busy_worker_pids(self) -> list[int]:
        """Process ids of live workers computing at least one request now."""
        return [w.pid for s in self._slots
                if (w := s.worker) is not None and w.live and w.inflight and w.pid]

    async def start(self) -> None:
        """Spawn every worker and wait until each has loaded and warmed its engine; if one cannot, close
        the pool and raise why."""
        loop = asyncio.get_running_loop()
        firsts: list[asyncio.Future[EngineInfo]] = [loop.create_future() for _ in self._slots]
        self._supervisors = [loop.create_task(self._supervise(slot, first), name=f"voicewire-worker-{slot.index}")
                             for slot, first in zip(self._slots, firsts, strict=True)]
        for task, first in zip(self._supervisors, firsts, strict=True):
            task.add_done_callback(functools.partial(_supervisor_ended, first))
        self._watchdog = loop.create_task(self._watch(), name="voicewire-worker-watchdog")
        try:
            infos = await asyncio.gather(*firsts)
        except BaseException:
            await self.close()
            raise
        self._info = replace(infos[0], max_concurrency=sum(i.max_concurrency for i in infos))

    async def close(self) -> None:
        """Stop every worker (killed after `STOP_GRACE_S`) and fail requests waiting for one."""
        self._closing = True
        self._notify()
        tasks = [*self._supervisors, *([self._watchdog] if self._watchdog else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        """Compute `request` on a live worker, waiting for one (and for a free slot on it) as long as the
        caller lets it; see the module docstring for failures and cancel."""
        rid = f"{request.request_id}#{next(self._ids)}"
        queue: asyncio.Queue[_Reply] = asyncio.Queue()
        while True:
            worker = await self._acquire()
            try:
                worker.send(Synth(rid, request))
                break
            except OSError:  # it died just now (its exit is on its way): wait for another
                worker.live = False
        worker.inflight[rid] = queue
        self._count(started=1)
        outcome = "cancelled"
        try:
            while True:
                match await queue.get():
                    case _Audio(piece=piece):
                        yield piece
                    case Done():
                        outcome = "completed"
                        return
                    case Failed(reason=reason, code=code):
                        outcome = "failed"
                        raise EngineWorkerError(reason, code)
                    case _Lost(reason=reason):
                        outcome = "failed"
                        raise EngineWorkerDied(reason)
        finally:
            worker.inflight.pop(rid, None)
            if outcome == "cancelled":
                self._cancel(worker, rid)
            self._notify()
            self._count(**{outcome: 1})

    # -- dispatch -----------------------------------------------------------------------------------

    async def _acquire(self) -> _Worker:
        """The least loaded live worker with a free slot, waiting until there is one."""
        self._waiting += 1
        try:
            while True:
                if self._closing:
                    raise EngineWorkerDied("the engine is shutting down")
                free = [w for s in self._slots
                        if (w := s.worker) is not None and w.live and w.load < w.capacity]
                if free:
                    # Least loaded first; among equals, rotate so idle workers share the work evenly.
                    turn = next(self._turns)
                    return min(free, key=lambda w: (w.load, (w.slot - turn) % self.workers))
                await self._changed.wait()
        finally:
            self._waiting -= 1

    def _notify(self) -> None:
        """Wake every request waiting for a worker (a worker became live, a slot freed, or closing)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _cancel(self, worker: _Worker, rid: str) -> None:
        if not worker.live:
            return  # gone or being replaced: nothing runs there to stop
        try:
            worker.send(Cancel(rid))
        except OSError:
            return
        loop = asyncio.get_running_loop()
        worker.cancelling[rid] = loop.call_later(self.timings.cancel_grace_s, self._cancel_overdue, worker, rid)

    def _cancel_overdue(self, worker: _Worker, rid: str) -> None:
        if worker.cancelling.pop(rid, None) is not None:
            self._replace(worker, f"did not stop a cancelled request within {self.timings.cancel_grace_s:g} s")

    def _replace(self, worker: _Worker, why: str) -> None:
        """Kill a live worker that misbehaves; its supervisor reaps it and starts another."""
        if not worker.live:
            return
        log.error("engine worker %d (pid %s) %s; killing and replacing it", worker.slot, worker.pid, why)
        worker.live = False
        worker.fate = f"{why} and was killed"
        worker.process.kill()

    async def _watch(self) -> None:
        """Kill live workers not heard from for `hang_s`. A tick that comes late (this loop was stalled)
        judges nobody: the reader threads may not have run either."""
        t = self.timings
        while True:
            before = time.monotonic()
            await asyncio.sleep(t.heartbeat_s)
            now = time.monotonic()
            if now - before > t.heartbeat_s + t.hang_s / 2:
                continue
            for slot in self._slots:
                w = slot.worker
                if w is not None and w.live and now - w.last_heard > t.hang_s:
                    self._replace(w, f"stopped answering (nothing heard for {now - w.last_heard:.1f} s)")

    # -- supervision --------------------------------------------------------------------------------

    async def _supervise(self, slot: _Slot, first: asyncio.Future[EngineInfo]) -> None:
        """Keep one worker running in `slot` (see the module docstring). The first start's outcome goes to
        `first`; if it fails, the supervisor ends (the pool's `start` raises)."""
        t = self.timings
        while True:
            slot.state = "starting"
            try:
                worker = self._launch(slot.index)
            except OSError as exc:  # out of processes or descriptors: count it as a death
                if not first.done():
                    first.set_exception(exc)
                    return
                await self._back_off(slot, f"could not be spawned ({exc})")
                continue
            slot.worker = worker
            polite = False  # ask it to stop (it may take STOP_GRACE_S) rather than kill it at once
            try:
                try:
                    info = await asyncio.wait_for(asyncio.shield(worker.ready), t.start_timeout_s)
                except Exception as exc:
                    polite = not isinstance(exc, TimeoutError)  # it reported its failure and is exiting
                    if not first.done():
                        first.set_exception(exc)
                        return
                    worker.fate = f"did not start ({str(exc) or f'not warm within {t.start_timeout_s:g} s'})"
                else:
                    if not worker.exited.is_set():
                        self._on_live(slot, worker, info, first)
                        try:
                            await asyncio.wait_for(worker.exited.wait(), t.stable_s)
                        except TimeoutError:
                            slot.failures = 0  # it stayed up: its next death is a first one
                            await worker.exited.wait()
            finally:
                # Not interrupted by close(): a half-reaped worker would leak its process and pipe.
                reaping = asyncio.ensure_future(self._reap(worker, graceful=polite or self._closing))
                try:
                    ended = await asyncio.shield(reaping)
                except asyncio.CancelledError:
                    await reaping
                    raise
                finally:
                    slot.worker = None
            await self._back_off(slot, f"(pid {ended.pid}) {worker.fate} with exit code {ended.exitcode}")

    async def _back_off(self, slot: _Slot, what: str) -> None:
        """Count a death of `slot`'s worker and wait before the next start: not at all after a first death,
        then `backoff_s` doubling up to `backoff_max_s`."""
        t = self.timings
        slot.failures += 1
        delay = 0.0 if slot.failures == 1 else min(t.backoff_max_s, t.backoff_s * 2 ** (slot.failures - 2))
        log.error("engine worker %d %s (%d in a row); restarting it%s", slot.index, what, slot.failures,
                  f" in {delay:.1f} s" if delay else "")
        if delay:
            slot.state = "backoff"
            await asyncio.sleep(delay)

    def _on_live(self, slot: _Slot, worker: _Worker, info: EngineInfo, first: asyncio.Future[EngineInfo]) -> None:
        worker.capacity = info.max_concurrency
        worker.last_heard = time.monotonic()
        worker.live = True
        slot.state = "live"
        if first.done():
            self._count(restarts=1)
            log.info("engine worker %d restarted (pid %s)", slot.index, worker.pid)
        else:
            first.set_result(info)
        self._notify()

    def _launch(self, index: int) -> _Worker:
        """Spawn one worker process and the thread that reads its pipe."""
        loop = asyncio.get_running_loop()
        parent, child = self._mp.Pipe()
        process = self._mp.Process(target=_worker_main, args=(child, self._build, self.timings.heartbeat_s),
                                   daemon=True, name=f"voicewire-{self.engine_name}-{index}")
        try:
            process.start()
        finally:
            child.close()
        worker = _Worker(slot=index, process=process, pid=process.pid, conn=parent, ready=loop.create_future())
        threading.Thread(target=self._read, args=(worker, loop), daemon=True,
                         name=f"voicewire-worker-{index}-reader").start()
        return worker

    async def _reap(self, worker: _Worker, *, graceful: bool) -> _Ended:
        """Make sure `worker` is gone, then join it and close its pipe and sentinel; only then may its slot
        start another. When `graceful`, a live worker is asked to stop, and one that was asked or reported a
        failed start gets `STOP_GRACE_S` to exit; any other is killed."""
        if graceful and worker.live:
            worker.live = False
            with contextlib.suppress(OSError):
                worker.send(Stop())
        if not worker.exited.is_set():
            if graceful and worker.ready.done():  # told to stop, or it reported a failed start: it exits
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(worker.exited.wait(), STOP_GRACE_S)
            if not worker.exited.is_set():
                worker.process.kill()
                await worker.exited.wait()  # the pipe's EOF: the reader thread is done with it
        await asyncio.to_thread(worker.process.join)
        if worker.ready.done() and not worker.ready.cancelled():
            worker.ready.exception()  # retrieved: a start that failed was logged by the supervisor
        ended = _Ended(worker.pid, worker.process.exitcode)
        worker.conn.close()
        worker.process.close()
        return ended

    def _read(self, worker: _Worker, loop: asyncio.AbstractEventLoop) -> None:
        """Reader thread: forwards each message of the worker to the loop (a `Piece` with its samples, a
        read-only array over the bytes received: the renderer only reads them); EOF means the worker is gone."""
        while True:
            try:
                message: FromWorker | _Audio = _decode_from_worker(worker.conn.recv_bytes())
                if isinstance(message, Piece):
                    raw = worker.conn.recv_bytes() if message.samples else b""
                    samples = np.frombuffer(raw, np.float32)
                    message = _Audio(message.rid, AudioPiece(samples, message.sample_rate, message.words,
                                                                  message.tokens))
            except (EOFError, OSError):
                break
            worker.last_heard = time.monotonic()
            try:
                loop.call_soon_threadsafe(self._deliver, worker, message)
            except RuntimeError:
                return  # the loop is closed
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._on_exit, worker)

    def _deliver(self, worker: _Worker, message: FromWorker | _Audio) -> None:
        match message:
            case Ready(info=info):
                if not worker.ready.done():
                    worker.ready.set_result(info)
            case StartFailed(reason=reason):
                if not worker.ready.done():
                    worker.ready.set_exception(RuntimeError(f"engine worker failed to start: {reason}"))
            case _Audio(rid=rid) | Done(rid=rid) | Failed(rid=rid):
                queue = worker.inflight.get(rid)
                if queue is not None:
                    queue.put_nowait(message)
            case Cancelled(rid=rid):
                timer = worker.cancelling.pop(rid, None)
                if timer is not None:
                    timer.cancel()
                    self._count(confirmed=1)
                    self._notify()
            case Heartbeat():
                pass

    def _on_exit(self, worker: _Worker) -> None:
        worker.live = False
        if not worker.ready.done():
            worker.ready.set_exception(RuntimeError("engine worker exited while starting"))
        reason = (f"engine worker {worker.slot} (pid {worker.pid}) {worker.fate} while computing this "
                  f"unit; it is being restarted")
        for queue in worker.inflight.values():
            queue.put_nowait(_Lost(reason))
        for timer in worker.cancelling.values():
            timer.cancel()
        worker.cancelling.clear()
        worker.exited.set()
        self._notify()

    def _count(self, **delta: int) -> None:
        self._stats = self._stats.plus(**delta)


def _supervisor_ended(first: asyncio.Future[EngineInfo], task: asyncio.Task[None]) -> None:
    """A supervisor ends only on close or a failed first start; anything else is a bug, logged, and must
    not leave `start()` waiting."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("engine worker supervisor failed", exc_info=exc)
        if not first.done():
            first.set_exception(exc)


# -- the child process -------------------------------------------------------------------------------


def _worker_main(conn: Connection, build: Callable[[], Engine], heartbeat_s: float) -> None:
    """Entry point of a worker process: serve requests from `conn` until told to stop or orphaned, on uvloop
    where it is installed, as the server does: the worker's loop wakes several times per request (the request,
    each engine job's end, each piece), and the default loop spends each wake-up in Python."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(conn, build, heartbeat_s))
    else:
        uvloop.run(_serve(conn, build, heartbeat_s))


_Outgoing = FromWorker | tuple[Piece, FloatAudio]
"""What the worker's loop hands its outbox: a message, or a piece's header and its samples (sent raw after it)."""


class _Outbox:
    """The worker's messages to the parent, sent in order by one thread: the event loop only queues them
    (no thread hop and wake-up per audio piece), and a parent slow to read blocks that thread, not the loop.
    Once the pipe fails (the parent is gone) the rest is dropped; the receive loop sees EOF and ends."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: SimpleQueue[_Outgoing | None] = SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="worker-outbox")
        self._thread.start()

    def send(self, message: _Outgoing) -> None:
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued (up to `STOP_GRACE_S`), then stop the thread."""
        self._queue.put(None)
        self._thread.join(STOP_GRACE_S)

    def _run(self) -> None:
        broken = False
        while (message := self._queue.get()) is not None:
            if broken:
                continue
            try:
                if isinstance(message, tuple):
                    head, samples = message
                    self._conn.send_bytes(_encode(head))
                    if head.samples:
                        self._conn.send_bytes(samples.data)
                else:
                    self._conn.send_bytes(_encode(message))
            except OSError:
                broken = True


async def _serve(conn: Connection, build: Callable[[], Engine], heartbeat_s: float) -> None:
    outbox = _Outbox(conn)
    try:
        await _serve_with(conn, outbox.send, build, heartbeat_s)
    finally:
        await asyncio.to_thread(outbox.close)


async def _serve_with(conn: Connection, send: Callable[[_Outgoing], None], build: Callable[[], Engine],
                      heartbeat_s: float) -> None:
    loop = asyncio.get_running_loop()
    engine = build()
    try:
        await engine.start()
    except Exception as exc:
        send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    send(Ready(engine.info))
    tasks: dict[str, asyncio.Task[None]] = {}
    helpers: set[asyncio.Task[None]] = set()
    ended: asyncio.Future[None] = loop.create_future()
    """Done once told to stop or orphaned (the pipe's EOF); no message is taken after."""

    async def run(rid: str, request: SynthesisRequest) -> None:
        try:
            async with contextlib.aclosing(engine.synthesize(request)) as pieces:
                async for piece in pieces:
                    samples = np.ascontiguousarray(piece.samples, np.float32)
                    send((Piece(rid, len(samples), piece.sample_rate, piece.words, piece.tokens), samples))
            send(Done(rid))
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            send(Failed(rid, reason, failure_of(exc)[0]))
        finally:
            tasks.pop(rid, None)

    async def cancel(rid: str) -> None:
        task = tasks.get(rid)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        await _threads_quiet(lambda: bool(tasks))
        send(Cancelled(rid))

    async def beat() -> None:
        while True:
            send(Heartbeat())
            await asyncio.sleep(heartbeat_s)

    def spawn(coro: Coroutine[None, None, None]) -> None:
        task = loop.create_task(coro)
        helpers.add(task)
        task.add_done_callback(helpers.discard)

    def receive(message: ToWorker | None) -> None:
        """One message from the parent, on the loop; None: the pipe's EOF (the parent is gone)."""
        if ended.done():
            return
        match message:
            case Synth(rid=rid, request=request):
                tasks[rid] = loop.create_task(run(rid, request))
            case Cancel(rid=rid):
                spawn(cancel(rid))
            case Stop() | None:
                ended.set_result(None)

    threading.Thread(target=_read_pipe, args=(conn, loop, receive), daemon=True, name="worker-inbox").start()
    _name_threads()
    spawn(beat())
    try:
        await ended
    finally:
        for task in [*tasks.values(), *helpers]:
            task.cancel()
        await asyncio.gather(*tasks.values(), *helpers, return_exceptions=True)
        await engine.close()


def _read_pipe(conn: Connection, loop: asyncio.AbstractEventLoop,
               receive: Callable[[ToWorker | None], None]) -> None:
    """The worker's reader thread: hands each message from the parent to `receive` on the loop, then None at
    the pipe's EOF; it ends there, or once the loop is closed."""
    while True:
        try:
            message: ToWorker | None = _decode_to_worker(conn.recv_bytes())
        except (EOFError, OSError):
            message = None
        try:
            loop.call_soon_threadsafe(receive, message)
        except RuntimeError:
            return  # the loop is closed
        if message is None:
            return


def _name_threads() -> None:
    """Give the kernel each thread's Python name (its first 15 characters), so that `top -H`, profilers and
    `bench.capacity` tell the engine's compute threads from the worker's own; best effort (Linux only)."""
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.native_id is None:
            continue
        with contextlib.suppress(OSError), open(f"/proc/self/task/{thread.native_id}/comm", "w") as f:
            f.write(thread.name[:15])


async def _threads_quiet(busy: Callable[[], bool]) -> None:
    """Return once this process's threads other than the running one (the event loop) used less than
    `QUIET_CPU_S` of CPU in each of `QUIET_WINDOWS` windows in a row, or at once while `busy()` (other
    requests run, so their threads' CPU says nothing about a cancelled one)."""
    quiet = 0
    while quiet < QUIET_WINDOWS and not busy():
        process, thread = time.process_time(), time.thread_time()
        await asyncio.sleep(QUIET_WINDOW_S)
        others = (time.process_time() - process) - (time.thread_time() - thread)
        quiet = quiet + 1 if others < QUIET_CPU_S else 0
