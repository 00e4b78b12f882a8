"""Starting, feeding and watching N worker processes, as vLLM's multiprocessing executor does.

The driver (the process that holds the scheduler) starts one process per rank with ``spawn`` --
a fresh interpreter, safe with CUDA and threads, importing only what it needs -- and keeps one
pipe to each. The ranks meet through a file rendezvous in a private temporary folder (no port to
race for) and join one ``torch.distributed`` process group; the driver is not part of it.

Each step the driver sends the scheduler's message to **every** rank, and waits for the answer of
one -- the output rank, 0 (vLLM V1's ``MultiprocExecutor`` collects one rank's output too) -- while
watching every process and every pipe: :func:`multiprocessing.connection.wait` returns when an answer
arrives, a rank writes an error, *or* a process exits. So a rank that dies -- killed, out of memory,
crashed in its forward pass -- ends the engine with :class:`WorkerDied` naming it, within one wait,
never a hang; the other ranks (blocked in an all-reduce the dead one will never join) are
terminated. A step that takes longer than ``step_timeout`` seconds ends the same way.

What a rank runs is the ``target`` it is given (:func:`cbteach.worker.worker.worker_main`): this
module knows processes and pipes, not models.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import pickle
import shutil
import tempfile
import time
import weakref

import torch.multiprocessing as torch_mp

from ..errors import EngineDeadError


def send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj))  # a plain copy: no shared-memory handles to outlive a step


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def _context(start_method: str, preload: str):
    """``spawn`` (the default): a fresh interpreter per worker -- safe with threads and CUDA, and
    nothing stays behind when the workers exit. ``forkserver``: one server process imports torch,
    transformers and the worker once and forks each worker from it (faster repeated starts; the
    server lives until this process exits). torch's contexts either way."""
    ctx = torch_mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([preload, "transformers"])
    return ctx


class WorkerDied(EngineDeadError):
    """A tensor-parallel rank died or failed: the group cannot go on, so the engine stops."""


_BOOTSTRAP_HINT = (
    " while starting. The most common cause: with the {method!r} start method each worker is a fresh interpreter "
    "that re-imports the script that started it, and a script that makes a tensor-parallel Engine at top level, "
    "outside `if __name__ == \"__main__\":`, makes every worker try to start workers of its own -- Python then stops "
    "it during its bootstrap (\"An attempt has been made to start a new process before the current process has "
    "finished its bootstrapping phase\", in the worker's traceback above). Put the code that makes the Engine under "
    "`if __name__ == \"__main__\":`.")


class WorkerGroup:
    """``len(setups)`` worker processes, one per rank, each running ``target(conn)``; :meth:`call` sends
    a message to all and returns the output rank's answer."""

    def __init__(self, setups: list, target, start_timeout: float = 300.0, step_timeout: float = 120.0,
                 start_method: str = "spawn"):
        self.step_timeout = step_timeout
        self._dir = tempfile.mkdtemp(prefix="cbteach-tp-")
        self._start_method = start_method
        self._starting = True  # until every rank said "ready": a death now is most often a bootstrap error
        ctx = _context(start_method, target.__module__)
        self.conns, self.procs = [], []
        self._grace = {"seconds": 5.0}  # how long close() waits for workers to stop by themselves
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._dir, self._grace)
        for setup in setups:
            setup.init_method = f"file://{self._dir}/rendezvous"
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child,), name=f"cbteach-tp-rank{setup.rank}", daemon=True)
            proc.start()
            child.close()  # the driver keeps its end only: a dead worker's end then reads as closed
            self.conns.append(parent)
            self.procs.append(proc)
            try:
                send(parent, setup)  # its shard, copied through the pipe
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                self._fail(f"rank {setup.rank} is gone before it received its shard{self._exit_note(setup.rank)}")
        self.memory = self._gather(start_timeout, "start", expect="ready", ranks=range(len(self.conns)))
        self._starting = False

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and all(p.is_alive() for p in self.procs)

    def call(self, msg, reply_rank: int = 0):
        """Send ``msg`` to every rank; the answer of ``reply_rank`` (``WorkerDied`` if any rank fails)."""
        if not self._finalizer.alive:
            raise WorkerDied("the tensor-parallel workers were stopped (the engine was closed or a rank died)")
        for rank, conn in enumerate(self.conns):
            try:
                send(conn, msg)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                self._fail(f"rank {rank} is gone (its pipe is closed){self._exit_note(rank)}")
        return self._gather(self.step_timeout, "step", expect="ok", ranks=[reply_rank])[reply_rank]

    def _gather(self, timeout: float, what: str, expect: str, ranks) -> list:
        """The answers of ``ranks``; any other rank that writes is failing (only errors come unasked)."""
        answers: list = [None] * len(self.conns)
        pending = {r: self.conns[r] for r in ranks}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"no answer from rank(s) {sorted(pending)} within {timeout:g} s ({what})")
            ready = mp.connection.wait([*self.conns, *(p.sentinel for p in self.procs)], timeout=left)
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    try:
                        kind, payload = recv(conn)
                    except (EOFError, OSError):
                        self._fail(f"rank {rank} closed its pipe{self._exit_note(rank)}")
                    if kind != expect or rank not in pending:
                        self._fail(payload if kind == "error" else f"rank {rank} answered {kind!r} to a {what}")
                    answers[rank] = payload
                    del pending[rank]
            for rank, proc in enumerate(self.procs):
                if proc.sentinel in ready and not self.conns[rank].poll():
                    self._fail(f"rank {rank} (pid {proc.pid}) died{self._exit_note(rank)}")
        return answers

    def _exit_note(self, rank: int) -> str:
        self.procs[rank].join(timeout=0.5)
        code = self.procs[rank].exitcode
        note = "" if code is None else f" with exit code {code}"
        if self._starting and code is not None and self._start_method != "fork":
            note += _BOOTSTRAP_HINT.format(method=self._start_method)
        return note

    def _fail(self, why: str):
        self._grace["seconds"] = 0.0  # the others may be blocked in an all-reduce: no point waiting
        self.close()
        raise WorkerDied(f"tensor parallelism stopped: {why}")

    def close(self) -> None:
        """Stop every worker (asked first, then terminated, then killed) and remove the rendezvous."""
        self._finalizer()


def _stop(procs, conns, folder, grace: dict) -> None:
    for conn in conns:
        try:
            send(conn, None)
        except (OSError, EOFError):
            pass
    deadline = time.monotonic() + grace["seconds"]
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(folder, ignore_errors=True)
