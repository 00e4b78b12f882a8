"""The API server's handle on its engine cores: start them, route requests, hear every step, notice death.

vLLM V1's ``AsyncMPClient`` and ``DPLBAsyncMPClient`` (``vllm/v1/engine/core_client.py``) in one
small class. :class:`CoreClient` starts ``data_parallel_size`` engine-core processes
(:mod:`.engine_core`), each with its own copy of the model and its own KV pool, and talks to them
over ZeroMQ: one PUSH socket per core for requests and aborts, one PULL socket that every core sends
its per-step outputs to. The sockets are ``ipc://`` files in a private temporary folder (only this
user can connect), or loopback TCP where ipc is missing.

**Routing (data parallelism).** Each new request goes to the least-loaded core, its load being the
tokens it still has to compute for the requests it holds, waiting or running -- each one's prompt
until its first token, plus the outputs it may still make -- as the API server counts them (it sees
every request go in and every token come out, so it never waits for a report). Ties go to the
lowest core. A request stays on its core: its KV cache is there.

**Death.** The event loop checks every core's process ten times a second. A core that exits when it
was not told to -- killed, out of memory, or after a :class:`~.core_messages.Dead` saying why --
fails every request it held with an error at once, turns ``/health`` unhealthy and calls
``on_dead``: the server takes no new request, lets the other cores finish theirs (the drain), and
exits non-zero. Never a request left waiting forever.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from . import core_messages as msg
from . import parent_death
from .engine_core import CoreSpec


WATCH_S = 0.1  # how often the event loop checks that every core is alive


class CoreStartError(RuntimeError):
    """An engine core could not start (a bad option, a model that does not load, a piece that fails)."""


class CoreClient:
    """``data_parallel_size`` engine cores and the sockets to them; ``processor`` hears their outputs."""

    def __init__(self, spec: CoreSpec, processor, data_parallel_size: int = 1):
        import zmq

        self.processor = processor
        self.num_cores = data_parallel_size
        self.folder = tempfile.mkdtemp(prefix="cbteach-core-")  # 0700: only this user may connect
        ipc = zmq.has("ipc")
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        out = self._bind(self.pull, "out", ipc)
        self.pushes, self.specs, self.procs = [], [], []
        for i in range(data_parallel_size):
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # never block the event loop: queue in memory instead
            push.setsockopt(zmq.LINGER, 0)
            self.pushes.append(push)
            self.specs.append(CoreSpec(**{**vars(spec), "index": i, "input_address": self._bind(push, f"in-{i}", ipc),
                                          "output_address": out, "parent_pid": os.getpid()}))
        processor.load = [0] * data_parallel_size
        processor.abort_in_core = lambda st: self._send(st.core, msg.Abort([st.request_id]))
        self.ready: list[msg.Ready] = []
        self.dead: str | None = None  # why the server can no longer serve (the first core that died)
        self.dead_cores: set = set()
        self.on_dead = None  # called once, on the event loop, when a core dies
        self.stopping = False
        self.bytes_in = self.messages_in = 0
        self._task = self._watch = self._apull = None

    def _bind(self, sock, name: str, ipc: bool) -> str:
        if ipc:
            address = f"ipc://{os.path.join(self.folder, name)}"
            sock.bind(address)
            return address
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return f"tcp://127.0.0.1:{port}"

    # -- start (before the event loop runs) ---------------------------------------------------------
    def start(self, timeout: float = 300.0, check=None) -> list[msg.Ready]:
        """Start every core and wait (bounded) until each has loaded its model; :class:`CoreStartError` if not.
        ``check()`` is called between cores and at least ten times a second while they load: whatever it raises
        stops the start (the caller stops the cores)."""

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        # Through parent_death.py: the core dies with this process even while it loads (see that module).
        # The kernel's parent-death signal fires when the *thread* that started it ends: main thread only.
        pdeathsig = "1" if threading.current_thread() is threading.main_thread() else "0"
        boot = [sys.executable, parent_death.__file__, str(os.getpid()), pdeathsig, "cbteach.serving.engine_core"]
        for spec in self.specs:
            if check is not None:
                check()
            proc = subprocess.Popen(boot, stdin=subprocess.PIPE, env=env, start_new_session=os.name == "posix")
            self.procs.append(proc)
            proc.stdin.write(json.dumps(vars(spec)).encode())
            proc.stdin.close()
        ready: dict[int, msg.Ready] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.num_cores:
            if check is not None:
                check()
            if self.pull.poll(100):
                m = msg.output_decoder.decode(self.pull.recv())
                if isinstance(m, msg.Dead):
                    self.close()
                    raise CoreStartError(f"engine core {m.core}: {m.message}")
                if isinstance(m, msg.Ready):
                    ready[m.core] = m
                continue
            for i, p in enumerate(self.procs):
                if p.poll() is not None and i not in ready:
                    self.close()
                    raise CoreStartError(f"engine core {i} exited with code {p.returncode} while starting")
            if time.monotonic() > deadline:
                self.close()
                raise CoreStartError(f"the engine cores did not start within {timeout:g} s")
        self.ready = [ready[i] for i in range(self.num_cores)]
        return self.ready

    # -- on the event loop ------------------------------------------------------------------------
    async def attach(self) -> None:
        """Hear the cores from this event loop: their outputs, and their deaths."""
        import zmq.asyncio

        loop = asyncio.get_running_loop()
        self._apull = zmq.asyncio.Socket.from_socket(self.pull)
        self._task = loop.create_task(self._hear())
        self._watch = loop.create_task(self._watch_cores())

    async def _hear(self) -> None:
        while True:
            data = await self._apull.recv()
            self.messages_in += 1
            self.bytes_in += len(data)
            m = msg.output_decoder.decode(data)
            if isinstance(m, msg.StepOutputs):
                self.processor.process(m, len(data))
            elif isinstance(m, msg.Dead):
                self._died(m.core, f"engine core {m.core} failed: {m.message.splitlines()[0]}")

    async def _watch_cores(self) -> None:
        while not self.stopping:
            for i, p in enumerate(self.procs):
                if p.poll() is not None and not self.stopping:
                    self._died(i, f"engine core {i} (pid {p.pid}) exited with code {p.returncode}")
            await asyncio.sleep(WATCH_S)

    def _died(self, core: int, why: str) -> None:
        """Core ``core`` is gone: the requests it held fail now; the others' cores go on while the server drains."""
        if core in self.dead_cores:
            return
        self.dead_cores.add(core)
        first = self.dead is None
        self.dead = self.dead or why
        self.processor.fail_all("dead", f"{why}; the server is shutting down", core=core)
        if first and self.on_dead is not None:
            self.on_dead(why)

    def submit(self, state, request: msg.AddRequest) -> int:
        """Route ``state`` to the least-loaded core and send it there; returns the core."""
        load = self.processor.load
        core = min(range(self.num_cores), key=lambda i: (load[i], i))
        payload = msg.encoder.encode(request)  # first: a value msgpack cannot carry fails before anything is kept
        self.processor.add(state, core)
        if core not in self.dead_cores:
            self.pushes[core].send(payload)
        return core

    def abort(self, state) -> None:
        """The client is gone (or the server is stopping): drop it in its core at once, end it here."""
        if not state.done:
            self._send(state.core, msg.Abort([state.request_id]))
            self.processor.end(state, "abort")

    def _send(self, core: int, m) -> None:
        if core not in self.dead_cores:
            self.pushes[core].send(msg.encoder.encode(m))

    @property
    def alive(self) -> bool:
        return self.dead is None and all(p.poll() is None for p in self.procs)

    # -- stop -------------------------------------------------------------------------------------
    async def shutdown(self, timeout: float = 10.0) -> None:
        """Tell every core to stop and wait for them (bounded; killed if they do not exit)."""
        self.stopping = True
        for i in range(self.num_cores):
            self._send(i, msg.Shutdown())
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in (self._task, self._watch):
            if task is not None:
                task.cancel()
        self.close()

    def close(self, grace: float = 0.5) -> None:
        """Stop everything now (bounded): the processes (``grace`` seconds to exit by themselves, together,
        then killed), the sockets, the folder."""
        self.stopping = True
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def exit_codes(self) -> list:
        return [p.poll() for p in self.procs]
