"""The engine core: the engine in a process of its own, stepped by a busy loop (vLLM V1's ``EngineCore``).

In one process, the engine and the web server share one interpreter lock: while the event loop
writes sixteen token streams, the engine waits for it, and the other way round. vLLM V1 moves the
engine into a process of its own (``vllm/v1/engine/core.py``, ``EngineCoreProc``) that does nothing
but this::

    while True:
        take every request and abort that has arrived     (block only when there is no work)
        plan = schedule(); out = execute(plan); update(plan, out)     # Engine.step()
        send ONE message with every sequence's new token ids

The API server (:mod:`.core_client`) does everything else -- HTTP, validation, tokenization,
detokenization, stop strings -- so the core spends its time stepping. Messages are small msgpack
structs (:mod:`.core_messages`) over ZeroMQ: a PULL socket for input, a PUSH socket for output,
both in the core's own I/O thread, so sending a step's outputs never waits for the API server.

What the loop also does, as a server's core must:

* **requests that fail alone end alone**: the engine ends a request whose sampling or model call
  failed with ``finish_reason="error"`` (its neighbours go on, exactly); that becomes a
  :class:`~.core_messages.Finished` with the error, and the API server answers that request --
  only that one -- with an error (``serve --fault-injection`` makes such failures for the tests:
  :mod:`.faults`);
* **an engine that fails as a whole** (a broken rule, a bug) sends :class:`~.core_messages.Dead`
  and exits non-zero: nothing is left running in a state nobody can trust;
* **it never outlives its API server**, whatever it is doing: it is started through
  :mod:`.parent_death` (the kernel's parent-death signal on Linux, a thread that watches the parent
  everywhere), which covers the seconds it spends importing torch and loading the model, and the
  loop checks its parent every turn too;
* it counts where its time went (stepping, waiting for requests, encoding and sending) and how many
  messages and bytes crossed the socket, and says so in every message: notebook 11 draws them.

Started by :class:`~.core_client.CoreClient` as ``python -m cbteach.serving.engine_core`` (through
:mod:`.parent_death`) with its
:class:`CoreSpec` on stdin (a fresh interpreter: no threads or CUDA state copied from the API
server, and no re-import of the user's script), in a session of its own, so that a Ctrl-C in the
terminal reaches the API server, which drains and then stops the cores.
"""
from __future__ import annotations

import importlib
import os
import json
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

from . import core_messages as msg
from .faults import FaultInjector

IDLE_POLL_MS = 200  # how long an idle core waits for a message before it checks on its parent
PIECES = {"scheduler": "scheduler_cls", "kv_manager": "kv_manager", "attention": "attention",
          "slot_mapping": "slot_mapping", "update_batch": "update_batch"}  # serve's --OPTION -> Engine's keyword


@dataclass
class CoreSpec:
    """Everything a core needs to build its engine and find its API server (picklable)."""

    index: int
    input_address: str
    output_address: str
    parent_pid: int
    model: str = "bierce"
    device: str = "cpu"
    threads: int = 1
    engine_options: dict = field(default_factory=dict)  # Engine(...) keywords: plain values
    pieces: dict = field(default_factory=dict)  # "scheduler" -> "MODULE:NAME", ...
    speculative_model: str | None = None  # a draft model's name, loaded here
    fault_injection: bool = False


def load_piece(spec: str, option: str):
    """``"MODULE:NAME"`` -> the object, imported as Python imports it; ``ValueError`` naming ``option`` if not."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--{option.replace('_', '-')} takes MODULE:NAME (e.g. my_pieces:MyScheduler), got {spec!r}")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"--{option.replace('_', '-')} {spec}: cannot import {module!r} ({err})") from None
    except (Exception, SystemExit) as err:  # noqa: BLE001  (the learner's module: a SyntaxError, a raise at import)
        where = f", line {err.lineno}" if isinstance(err, SyntaxError) else ""
        raise ValueError(f"--{option.replace('_', '-')} {spec}: importing {module!r} raised "
                         f"{type(err).__name__}{where}: {err}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--{option.replace('_', '-')} {spec}: {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def build_engine(spec: CoreSpec):
    from ..engine.engine import Engine
    from ..models import load_model

    import torch

    if spec.device == "cpu":
        torch.set_num_threads(spec.threads)
    model, tok = load_model(spec.model, device=None if spec.device == "auto" else spec.device)
    options = dict(spec.engine_options)
    if spec.speculative_model:
        try:
            options["speculative"] = load_model(spec.speculative_model, device=model.device)[0]
        except ValueError as err:
            raise ValueError(f"--speculative {spec.speculative_model!r} is neither 'ngram' nor a draft model that can "
                             f"be loaded (the embedded one: --speculative bierce-draft): {err}") from None
    pieces = {PIECES[k]: load_piece(v, k) for k, v in spec.pieces.items() if v}
    return Engine(model, tok, keep_records=False, **options, **pieces)


def ready_message(index: int, engine) -> msg.Ready:
    gen = engine.model.generation_config
    kv = engine.kv
    return msg.Ready(core=index, pid=os.getpid(), max_positions=engine.info.max_positions or 0,
                     vocab_size=engine.info.vocab_size, max_batch_size=engine.scheduler.max_batch_size,
                     kv_kind=kv.kind, num_blocks=getattr(kv, "num_blocks", 0) or 0,
                     block_size=getattr(kv, "block_size", 0) or 0,
                     default_temperature=float(gen.temperature or 1.0) if gen.do_sample else 0.0)


class EngineCore:
    """The busy loop around one engine, between a PULL socket (requests in) and a PUSH socket (outputs out)."""

    def __init__(self, spec: CoreSpec, engine, inbox, outbox):
        from ..core.request import Request
        from ..core.sampling import SamplingParams

        self.spec, self.engine, self.inbox, self.outbox = spec, engine, inbox, outbox
        self.Request, self.SamplingParams = Request, SamplingParams
        self.stats = msg.CoreStats(kv_total=getattr(engine.kv, "num_blocks", 0) or 0)
        self.t0 = time.perf_counter()
        self.accepted: list = []
        self.rejected: list = []
        self.changed = False  # an abort (or an admission) changed the counts since the last message
        self.stopping = False
        self.faults = FaultInjector(engine) if spec.fault_injection else None  # tests only

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while not self.stopping:
            busy = self.engine.has_requests()  # (finished ones the worker still holds count: V1's rule)
            t = time.perf_counter()
            if busy or poller.poll(IDLE_POLL_MS):
                self._take_inputs()
            if not busy:
                self.stats.idle_s += time.perf_counter() - t
            if os.getppid() != self.spec.parent_pid:
                return  # the API server is gone: nobody will read what we make
            if self.engine.has_requests():
                self._step()
            elif self.accepted or self.rejected or self.changed:
                self._send(-1, [], [], [], [])  # nothing to step, but the API server must hear of it

    def _take_inputs(self) -> None:
        import zmq

        t = time.perf_counter()
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.stats.num_messages_in += 1
            self.stats.bytes_in += len(data)
            m = msg.input_decoder.decode(data)
            if isinstance(m, msg.AddRequest):
                self._add(m)
            elif isinstance(m, msg.Abort):
                for rid in m.request_ids:
                    self._abort(rid)
            else:
                self.stopping = True
        self.stats.io_s += time.perf_counter() - t

    def _add(self, m: msg.AddRequest) -> None:
        sp = self.SamplingParams(temperature=m.temperature, top_p=m.top_p, seed=m.seed,
                                 stop_token_ids=m.stop_token_ids)
        try:
            self.engine.add_request(self.Request(m.prompt_token_ids, m.max_tokens, request_id=m.request_id,
                                                 sampling_params=sp, ignore_eos=m.ignore_eos, priority=m.priority))
        except ValueError as err:  # the engine's own checks: the KV pool, a duplicate id, ...
            self.rejected.append((m.request_id, str(err)))
            return
        self.accepted.append(m.request_id)
        if m.fail_after is not None and self.faults is not None:
            self.faults.add(m.request_id, m.fail_after)

    def _abort(self, rid: str) -> None:
        seq = self.engine.sequences.get(rid)
        if seq is not None and not seq.status.is_finished:
            self.engine.abort(rid)  # its blocks go back to the pool now
            self.changed = True
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        """A long-running server must not keep every request it ever served (Engine.release)."""
        seq = self.engine.sequences.get(rid)
        if seq is not None and seq.status.is_finished:
            self.engine.release(rid)
        if self.faults is not None:
            self.faults.forget(rid)

    def _step(self) -> None:
        t = time.perf_counter()
        record = self.engine.step()
        duration = time.perf_counter() - t
        self.stats.step_s += duration
        if record.idle:  # nothing could run and nothing is due later: the engine's own error
            self.engine.wait_for_arrival()
            return
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(record.preempted)
        outputs = [msg.SeqOutput(s.request_id, list(s.new_token_ids), s.slot if s.slot is not None else -1, s.kind,
                                 s.num_scheduled_tokens) for s in record.seqs]
        finished = []
        for rid in record.finished:
            seq = self.engine.sequences[rid]
            finished.append(msg.Finished(rid, seq.finish_reason, getattr(seq, "error", None)))
            self._forget(rid)
        if self.faults is not None:
            finished += self.faults.after_step(outputs, self._abort)
        self._send(self.engine.num_steps - 1, outputs, finished, list(record.admitted), list(record.preempted),
                   duration)

    def _send(self, step: int, outputs, finished, admitted, preempted, duration: float = 0.0) -> None:
        t = time.perf_counter()
        s, sched = self.stats, self.engine.scheduler
        s.num_running = len(sched.running)
        s.num_waiting = len(sched.waiting) + len(getattr(sched, "swapped", ()))
        s.kv_used = self._kv_used()
        s.num_messages_out += 1
        out = msg.StepOutputs(core=self.spec.index, step=step, t=t - self.t0, outputs=outputs, finished=finished,
                              accepted=self.accepted, rejected=self.rejected, admitted=admitted,
                              preempted=preempted, duration=duration, stats=s)
        data = msg.encoder.encode(out)
        self.outbox.send(data)  # (copy=False is for large messages: a small one is copied faster)
        s.bytes_out += len(data)
        self.accepted, self.rejected, self.changed = [], [], False
        s.io_s += time.perf_counter() - t

    def _kv_used(self) -> int:
        manager = self.engine.kv.manager
        free = getattr(manager, "num_free_blocks", None)
        if isinstance(free, int) and self.stats.kv_total:
            return self.stats.kv_total - free
        return int(self.engine.kv_usage().get("num_used_blocks") or 0)


def run_engine_core(spec: CoreSpec) -> int:
    """Build the engine, say Ready, loop; returns the exit status (0: told to stop)."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API server's to handle: it drains, then stops us
    ctx = zmq.Context(io_threads=1)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(spec.output_address)
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec.input_address)
    code = 0
    try:
        engine = build_engine(spec)
    except Exception as err:  # a bad option, a model that cannot load, a piece that does not import
        outbox.send(msg.encoder.encode(msg.Dead(spec.index, f"{type(err).__name__}: {err}")))
        code = 2
    else:
        outbox.send(msg.encoder.encode(ready_message(spec.index, engine)))
        try:
            EngineCore(spec, engine, inbox, outbox).run()
        except Exception as err:  # the engine failed as a whole: say why, and stop
            detail = traceback.format_exc(limit=-4)
            outbox.send(msg.encoder.encode(msg.Dead(spec.index, f"{type(err).__name__}: {err}\n{detail}")))
            code = 1
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
    inbox.close(0)
    outbox.close()  # lingers until the last message is out (bounded)
    ctx.term()
    return code


if __name__ == "__main__":  # started by CoreClient: python -m cbteach.serving.engine_core < spec.json
    status = run_engine_core(CoreSpec(**json.loads(sys.stdin.read())))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the sockets are flushed and closed: skip the interpreter's slow teardown of torch
