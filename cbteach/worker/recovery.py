"""One request's failure is its own: cbteach's rule, not vLLM V1's.

In V1 an exception in the worker's forward pass ends the engine (its worker re-raises; the engine core
shuts down). A teaching engine that runs learners' pieces and a server's requests side by side does
better to fail only the request the model fails on, so the worker here:

* gives a row whose sampling fails, or whose logits are not finite, an error instead of a token
  (:func:`cbteach.worker.model_runner.sample_on_device`) -- after running it again alone when it shared
  its step with others (:func:`note_rows`): attention masks a key by giving it weight 0, and 0 times a
  neighbour's NaN is NaN;
* when the forward pass itself raises, runs each row of the step alone (:func:`recover`) -- paged K/V
  are written in place, so running a row again rewrites the same values -- and fails the rows the
  model still fails on. Rows of one step may share blocks (a prefix-cache hit on blocks another row of
  the same step fills): run alone, a row may come before the row that fills them, so every block the
  step was to fill counts as unwritten until the row that fills it has run;
* remembers the blocks a failed row was to fill as **unwritten** (:func:`mark_written`). Another
  request may read them as its cached prefix -- admitted on them, perhaps planned a step ahead (async
  scheduling) before the failure was known. Such a row computes them again itself, from the first
  unwritten block on (:func:`redo_from`): the same tokens at the same positions give the same K/V.

Breaking a rule of the engine (:class:`~cbteach.errors.EngineRuleError`) is never one request's fault,
and a dead worker process (:class:`~cbteach.errors.EngineDeadError`) is nobody's: both stop the step.
"""
from __future__ import annotations

import numpy as np

from ..core.scheduler_output import RunnerOutput
from ..errors import EngineDeadError, EngineRuleError
from .step import NOT_FINITE, NOT_FINITE_KV, Step


def recover(runner, step, err: Exception) -> RunnerOutput:
    """``step``'s forward pass raised ``err``: run each row alone; the ones the model fails on get an
    error, and the blocks they were to fill are unwritten."""
    for rid, start, count in zip(step.req_ids, step.starts, step.counts):
        written(runner, rid, start, count, ok=False)  # nothing this step wrote counts until its row has run
    parts = []
    for i, (rid, start, count) in enumerate(zip(step.req_ids, step.starts, step.counts)):
        if rid not in runner.requests:  # finished by a message sent since (async scheduling): nothing to give it
            parts.append(RunnerOutput(sampled=[None], req_ids=[rid]))
            continue
        try:
            if len(step.rows) == 1:
                raise err
            one = alone(runner, step, i)
            runner.forward(one)
            runner.sample(one)
            parts.append(runner.finish(one))
        except (EngineRuleError, EngineDeadError):
            raise
        except Exception as e:  # noqa: BLE001  (the model failed on this row's tokens)
            written(runner, rid, start, count, ok=False)
            message = f"the model failed on this request's tokens: {type(e).__name__}: {e}"
            parts.append(RunnerOutput(sampled=[None], req_ids=[rid], errors=[message]))
    return getattr(runner, "join_outputs", join)(step.req_ids, parts)  # (a runner whose outputs carry more joins its own)


def join(req_ids: list, parts: list) -> RunnerOutput:
    """One output for the step from its rows' own, one row each, in the step's order."""
    return RunnerOutput(
        sampled=[p.sampled[0] for p in parts], req_ids=list(req_ids),
        forward_time=sum(p.forward_time for p in parts), traffic=next((p.traffic for p in parts if p.traffic), None),
        errors=[p.error(0) for p in parts])


def alone(runner, step, i: int) -> Step:
    """Row ``i`` of ``step`` as a step of its own, read from the request's state and the step -- not from
    the batch's rows, which the next message may have changed already (async scheduling). A row before
    it that failed leaves blocks unwritten that this one may read: it computes them again."""
    state = runner.requests[step.req_ids[i]]
    start, count = step.starts[i], step.counts[i]
    if runner.unwritten_blocks and runner.block_size is not None:
        start, count = redo_from(runner.unwritten_blocks, state.block_ids, start, count, runner.block_size)
    # Each position's token: the request's, where known by now; else what the step fed there (tokens
    # fed after the known ones; 0 for one a failed step in flight never gave).
    known, fed, at = state.prompt_token_ids + state.output_token_ids, step.input_ids, sum(step.counts[:i]) - step.starts[i]
    ids = np.asarray([known[p] if p < len(known) else fed[at + p] for p in range(start, start + count)], dtype=np.int64)
    one = step.row(i, input_ids=ids)
    one.starts, one.counts = [start], [count]
    runner.build_inputs(one, [state.block_ids])
    return one


def redo_rows(runner, req_ids: list, starts: list, counts: list) -> None:
    """A step's rows (``starts``/``counts``, changed in place) begin at the first unwritten block they read."""
    for i, rid in enumerate(req_ids):
        starts[i], counts[i] = redo_from(runner.unwritten_blocks, runner.requests[rid].block_ids, starts[i], counts[i],
                                         runner.block_size)


def note_rows(runner, step, sampled: list, errors: list) -> tuple[list, list]:
    """After a step's rows ran: the blocks of each row without an error hold its K/V, the others never will.
    A NaN can reach a neighbour's row: the concatenating cache attends every row over the whole packed cache,
    masked -- and a masked key's weight 0 times a NaN value is NaN -- and a paged row may read, as its cached
    prefix, blocks a failing row of the same step fills. So a row whose logits (or, concat, new K/V) are not
    finite runs again alone -- concat: its K/V of this step dropped first; paged: the failing rows' blocks
    counted as unwritten first, so it computes them itself -- and only one that fails alone too fails. (Under
    async scheduling the step behind waits for this: ``AsyncModelRunner.held``.) Returns ``(sampled, errors)``."""
    if runner.block_size is None:
        return _alone_again(runner, step, sampled, errors)
    if len(step.rows) > 1 and NOT_FINITE in errors:
        for i, e in enumerate(errors):
            if e is not None:
                written(runner, step.req_ids[i], step.starts[i], step.counts[i], ok=False)
        sampled, errors = _alone_again(runner, step, sampled, errors)
    rows = range(len(errors)) if runner.unwritten_blocks else [i for i, e in enumerate(errors) if e is not None]
    for i in rows:
        written(runner, step.req_ids[i], step.starts[i], step.counts[i], ok=errors[i] is None)
    return sampled, errors


def _alone_again(runner, step, sampled: list, errors: list) -> tuple[list, list]:
    sampled, errors, suspects = list(sampled), list(errors), set(step.meta.non_finite_rows)
    if len(step.rows) == 1:  # no neighbour to blame
        return sampled, [NOT_FINITE_KV if i in suspects and e is None else e for i, e in enumerate(errors)]
    for i, rid in enumerate(step.req_ids):
        if (errors[i] != NOT_FINITE and i not in suspects) or rid not in runner.requests:
            continue
        if runner.block_size is None:
            runner.kv_cache.truncate(rid, step.starts[i])
        one = alone(runner, step, i)
        try:
            runner.forward(one)
            runner.sample(one)
            (sampled[i],), (errors[i],) = runner.sampled_tokens(one)
            step.take_row(i, one)
            if one.meta.non_finite_rows:  # its own K/V are not finite: whatever it sampled, it failed
                sampled[i], errors[i] = None, errors[i] or NOT_FINITE_KV
        except (EngineRuleError, EngineDeadError):
            raise
        except Exception as e:  # noqa: BLE001  (the model failed on this row's tokens)
            sampled[i], errors[i] = None, f"the model failed on this request's tokens: {type(e).__name__}: {e}"
        if runner.block_size is not None:  # the blocks it ran over, from where it started alone
            written(runner, rid, one.starts[0], one.counts[0], ok=errors[i] is None)
    return sampled, errors


def written(runner, rid, start: int, count: int, ok: bool) -> None:
    """After a row ran: its blocks hold its K/V (``ok``), or never will -- and may hold NaN from now on, which
    attention then keeps from spreading (``PagedKVPool.may_hold_nan``)."""
    if runner.block_size is not None and not ok:
        runner.kv_cache.pool.may_hold_nan = True
    if runner.block_size is not None and (not ok or runner.unwritten_blocks):
        state = runner.requests.get(rid)
        mark_written(runner.unwritten_blocks, [] if state is None else state.block_ids, start, count, ok,
                     runner.block_size)


def redo_from(unwritten: set, block_ids: list[int], start: int, count: int, block_size: int) -> tuple[int, int]:
    """A row feeding ``count`` tokens from ``start``: if the blocks before ``start`` hold one whose K/V
    were never written, it starts at that block instead (and feeds the tokens in between too)."""
    first = next((k for k, b in enumerate(block_ids[:-(-start // block_size)]) if b in unwritten), None)
    if first is None:
        return start, count
    return first * block_size, count + start - first * block_size


def mark_written(unwritten: set, block_ids: list[int], start: int, count: int, ok: bool, block_size: int) -> None:
    """After a row fed positions ``start .. start + count - 1``: the blocks holding them have their K/V
    (``ok``), or never will (the model failed on the row)."""
    blocks = block_ids[start // block_size:(start + count - 1) // block_size + 1]
    if ok:
        unwritten.difference_update(blocks)
    else:
        unwritten.update(blocks)
