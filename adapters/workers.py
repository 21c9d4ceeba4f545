"""Process isolation for CPU engines: each worker is a child process running its own engine.

`ProcessEngine` implements the engine interface by dispatching every request to one of `workers` child
processes (spawned, never forked), each running the named engine (`create_engine(name, workers=1)`) on
its own event loop. Requests go down a pipe, audio pieces stream back as they are computed.

Why processes: an engine crash (a native fault, the OOM killer, `kill -9`) takes one worker down, not
the server. When a worker dies, only the requests it was computing fail (with `EngineWorkerDied`), and
a fresh worker is started and warmed in the background; until it is ready its share of capacity is
missing, never its neighbours'. Python code in engines (G2P, DSP glue) also stops competing with the
server's event loop for the GIL.

Cancel: closing a request's iterator sends a cancel to its worker, which cancels the engine request
there (for hibari that terminates the onnxruntime run). Memory per request in the parent: the pieces
received but not yet consumed, bounded by one unit's audio.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from voicewire.adapters.base import AudioPiece, EngineInfo, SynthesisRequest

log = logging.getLogger("voicewire.workers")

START_TIMEOUT_S = 120.0
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0


class EngineWorkerDied(RuntimeError):
    """The worker process computing this request exited; the request is lost, the server is not."""


class EngineWorkerError(RuntimeError):
    """The engine in a worker raised; the message is the worker's exception text."""


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """Requests by outcome, across all workers, plus how many workers were restarted after dying."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    restarts: int = 0


@dataclass(eq=False)
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    ready: asyncio.Future[EngineInfo]
    alive: bool = True
    inflight: dict[str, asyncio.Queue[tuple[str, Any]]] = field(default_factory=dict)
    """Requests in flight and their piece queues. Only the event loop sends on `conn` (its reader thread only
    receives), so sends need no lock."""


class ProcessEngine:
    """The engine `engine_name` in `workers` child processes (see the module docstring)."""

    def __init__(self, engine_name: str, *, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.engine_name = engine_name
        self.workers = workers
        self._pool: list[_Worker | None] = [None] * workers
        self._info: EngineInfo | None = None
        self._ids = itertools.count()
        self._turns = itertools.count()
        self._closing = False
        self._restarts: set[asyncio.Task[None]] = set()
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

    def worker_pids(self) -> list[int | None]:
        """The process id of each worker slot (None while it is being replaced)."""
        return [w.process.pid if w is not None and w.alive else None for w in self._pool]

    def busy_worker_pids(self) -> list[int]:
        """Process ids of workers computing at least one request now."""
        return [w.process.pid for w in self._pool if w is not None and w.alive and w.inflight and w.process.pid]

    async def start(self) -> None:
        """Spawn every worker and wait until each has loaded and warmed its engine."""
        infos = await asyncio.gather(*(self._spawn(i) for i in range(self.workers)))
        first = infos[0]
        self._info = replace(first, max_concurrency=sum(i.max_concurrency for i in infos))

    async def close(self) -> None:
        self._closing = True
        for task in self._restarts:
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        for worker in self._pool:
            if worker is not None:
                await self._stop(worker)

    async def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        worker = self._pick()
        rid = f"{request.request_id}#{next(self._ids)}"
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        worker.inflight[rid] = queue
        self._count(started=1)
        outcome = "cancelled"
        try:
            try:
                worker.conn.send(("synth", rid, request))
            except OSError as exc:
                outcome = "failed"
                raise EngineWorkerDied(f"engine worker {worker.index} is gone; it is being restarted") from exc
            while True:
                kind, payload = await queue.get()
                if kind == "piece":
                    yield payload
                elif kind == "done":
                    outcome = "completed"
                    return
                elif kind == "died":
                    outcome = "failed"
                    raise EngineWorkerDied(f"engine worker {worker.index} (pid {worker.process.pid}) died "
                                           f"while computing this unit; it is being restarted")
                else:
                    outcome = "failed"
                    raise EngineWorkerError(str(payload))
        finally:
            worker.inflight.pop(rid, None)
            if outcome == "cancelled" and worker.alive:
                try:
                    worker.conn.send(("cancel", rid))
                except OSError:
                    pass
            self._count(**{outcome: 1})

    # -- workers ------------------------------------------------------------------------------------

    def _pick(self) -> _Worker:
        live = [w for w in self._pool if w is not None and w.alive and w.ready.done()]
        if not live:
            raise EngineWorkerDied("no engine worker is running; they are being restarted")
        # Least loaded first; among equals, rotate so idle workers share the work evenly.
        turn = next(self._turns)
        return min(live, key=lambda w: (len(w.inflight), (w.index - turn) % self.workers))

    async def _spawn(self, index: int) -> EngineInfo:
        loop = asyncio.get_running_loop()
        parent, child = self._mp.Pipe()
        process = self._mp.Process(target=_worker_main, args=(child, self.engine_name), daemon=True,
                                   name=f"voicewire-{self.engine_name}-{index}")
        process.start()
        child.close()
        worker = _Worker(index=index, process=process, conn=parent, ready=loop.create_future())
        self._pool[index] = worker
        threading.Thread(target=self._read, args=(worker, loop), daemon=True,
                         name=f"voicewire-worker-{index}-reader").start()
        try:
            return await asyncio.wait_for(asyncio.shield(worker.ready), START_TIMEOUT_S)
        except BaseException:
            self._pool[index] = None  # its exit is this failure, not a death to restart from
            await self._stop(worker)
            raise

    def _read(self, worker: _Worker, loop: asyncio.AbstractEventLoop) -> None:
        """Reader thread: forwards each message of the worker to the loop; EOF means the worker died."""
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                break
            try:
                loop.call_soon_threadsafe(self._deliver, worker, message)
            except RuntimeError:
                return
        try:
            loop.call_soon_threadsafe(self._on_exit, worker)
        except RuntimeError:
            return

    def _deliver(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            if not worker.ready.done():
                worker.ready.set_result(message[1])
        elif kind == "failed":
            if not worker.ready.done():
                worker.ready.set_exception(RuntimeError(f"engine worker failed to start: {message[1]}"))
        else:
            queue = worker.inflight.get(message[1])
            if queue is not None:
                queue.put_nowait((kind, message[2] if len(message) > 2 else None))

    def _on_exit(self, worker: _Worker) -> None:
        worker.alive = False
        worker.conn.close()
        if not worker.ready.done():
            worker.ready.set_exception(RuntimeError("engine worker exited while starting"))
        for queue in worker.inflight.values():
            queue.put_nowait(("died", None))
        if self._closing or self._pool[worker.index] is not worker:
            return
        log.error("engine worker %d (pid %s) exited with code %s; restarting it", worker.index,
                  worker.process.pid, worker.process.exitcode)
        self._pool[worker.index] = None
        task = asyncio.get_running_loop().create_task(self._restart(worker))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, dead: _Worker) -> None:
        """Replace a dead worker, retrying failed starts after 0.5 s, doubling to 30 s, so an engine that
        cannot load does not respawn in a tight loop."""
        await asyncio.to_thread(dead.process.join, 5.0)  # reap it: no zombie left behind
        delay = RESTART_BACKOFF_S
        while not self._closing:
            try:
                await self._spawn(dead.index)
            except Exception:
                log.exception("engine worker %d could not be restarted; retrying in %.1f s", dead.index, delay)
                await asyncio.sleep(delay)
                delay = min(RESTART_BACKOFF_MAX_S, delay * 2)
                continue
            self._count(restarts=1)
            log.info("engine worker %d restarted", dead.index)
            return

    async def _stop(self, worker: _Worker) -> None:
        worker.alive = False
        try:
            worker.conn.send(("stop",))
        except OSError:
            pass
        await asyncio.to_thread(worker.process.join, 5.0)
        if worker.process.is_alive():
            worker.process.kill()
            await asyncio.to_thread(worker.process.join, 5.0)
        worker.conn.close()

    def _count(self, **delta: int) -> None:
        s = self._stats
        self._stats = WorkerStats(**{k: getattr(s, k) + delta.get(k, 0) for k in WorkerStats.__dataclass_fields__})


# -- the child process -------------------------------------------------------------------------------


def _worker_main(conn: Connection, engine_name: str) -> None:
    """Entry point of a worker process: serve requests from `conn` until told to stop or orphaned."""
    asyncio.run(_serve(conn, engine_name))


async def _serve(conn: Connection, engine_name: str) -> None:
    from voicewire.adapters.registry import create_engine

    loop = asyncio.get_running_loop()
    engine = create_engine(engine_name, workers=1)
    try:
        await engine.start()
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", engine.info))
    tasks: dict[str, asyncio.Task[None]] = {}
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    async def run(rid: str, request: SynthesisRequest) -> None:
        try:
            async for piece in engine.synthesize(request):
                await asyncio.to_thread(send, ("piece", rid, piece))
            send(("done", rid))
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            send(("error", rid, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__))
        finally:
            tasks.pop(rid, None)

    try:
        while True:
            try:
                message = await asyncio.to_thread(conn.recv)
            except (EOFError, OSError):
                return
            if message[0] == "synth":
                rid, request = message[1], message[2]
                tasks[rid] = loop.create_task(run(rid, request))
            elif message[0] == "cancel":
                task = tasks.get(message[1])
                if task is not None:
                    task.cancel()
            elif message[0] == "stop":
                return
    finally:
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await engine.close()
