"""Fault injection for the server's tests: make one request fail inside its engine core, and only it.

A server is only as good as what it does when something goes wrong for one request. To test that
over HTTP, ``serve --fault-injection`` accepts a body field ``cbteach_fail_after: k``: that request
fails at its first forward pass after it has ``k`` tokens. The failure is a real one, inside the
engine: a forward pre-hook on the core's own copy of the model (a public torch hook, which the
engine's view of the model shares) raises when the step writes K/V into one of that request's
blocks (the step's ``slot_mapping``). The engine then reruns the step one sequence at a time, and
only the marked request ends -- ``finish_reason="error"``, its blocks freed -- while its neighbours
go on, exactly as they would have.

The concatenating cache has no slots to recognise a request by, and under tensor parallelism the core's
model never runs (the ranks run their shards); there the engine core ends the marked request itself, as
such a failure would end it (aborted, ``finish_reason="error"``).
"""
from __future__ import annotations

from . import core_messages as msg

MESSAGE = "a fault injected for tests"


class FaultInjector:
    """Requests to fail (request id -> tokens after which it fails), and the hook that fails them."""

    def __init__(self, engine):
        from ..attention.paged import STEP_KWARG

        self.engine, self.kwarg = engine, STEP_KWARG
        self.after: dict = {}  # request id -> fail once it has this many tokens
        self.counts: dict = {}
        self.armed: set = set()  # request ids whose next forward pass fails
        self.in_forward = engine.kv.kind == "paged" and engine.config.tensor_parallel_size == 1
        if self.in_forward:
            engine.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def add(self, request_id: str, fail_after: int) -> None:
        self.after[request_id], self.counts[request_id] = fail_after, 0
        if fail_after == 0 and self.in_forward:
            self.armed.add(request_id)

    def forget(self, request_id: str) -> None:
        self.after.pop(request_id, None)
        self.counts.pop(request_id, None)
        self.armed.discard(request_id)

    def _hook(self, module, args, kwargs):
        meta = kwargs.get(self.kwarg)
        if not self.armed or meta is None or meta.slot_mapping is None:
            return None
        written = {slot // meta.block_size for slot in meta.slot_mapping.tolist()}
        for rid in self.armed:
            seq = self.engine.sequences.get(rid)
            if seq is not None and written & set(seq.block_table):
                raise RuntimeError(MESSAGE)
        return None

    def after_step(self, outputs, abort) -> list:
        """Count the step's tokens; arm (or, without the hook, end) requests that reached their count.
        Returns the :class:`~.core_messages.Finished` of requests ended here."""
        failed = []
        for o in outputs:
            limit = self.after.get(o.request_id)
            if limit is None:
                continue
            before = self.counts[o.request_id]
            self.counts[o.request_id] = before + len(o.new_token_ids)
            if self.in_forward and self.counts[o.request_id] >= limit:
                self.armed.add(o.request_id)
            elif not self.in_forward and self.counts[o.request_id] > limit:
                o.new_token_ids = o.new_token_ids[:limit - before]
                abort(o.request_id)
                failed.append(msg.Finished(o.request_id, "error", f"sampling failed: {MESSAGE}"))
        return failed
