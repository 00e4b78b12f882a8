"""The plan as a message: each step's ``SchedulerOutput`` in bytes, beside the context the runner holds.

The scheduler sends the model runner plain data (:mod:`cbteach.core.scheduler_output`): a request the
runner has not seen goes in whole (its prompt), one it holds goes as a small diff. So a message's
size follows the *new* requests of its step, not the length of anyone's context -- which grows every
step in the worker's own persistent batch (:mod:`cbteach.worker.input_batch`). Notebook 06 draws it.
"""
from __future__ import annotations

import pickle

from .style import get_axes


def message_sizes(messages) -> list[tuple[int, int]]:
    """Per message: (bytes of its new requests' data, bytes of everything else), pickled."""
    out = []
    for m in messages:
        new = len(pickle.dumps(m.scheduled_new_reqs)) if m.scheduled_new_reqs else 0
        out.append((new, len(pickle.dumps(m)) - new))
    return out


def plot_messages(messages, records, ax=None) -> list[int]:
    """Bars: each step's message in bytes (new requests' data, the rest); line: the tokens of context
    its requests have in the runner's batch after the step (``records``: the run's step records, one
    per message that ran something). Returns each message's total size in bytes."""
    sizes = message_sizes([m for m in messages if m.num_scheduled_tokens])
    _, ax = get_axes(ax, (11, 3.6))
    steps = range(len(sizes))
    new = [n for n, _ in sizes]
    rest = [r for _, r in sizes]
    ax.bar(steps, rest, color="#4C78A8", label="cached requests and the rest")
    ax.bar(steps, new, bottom=rest, color="#F58518", label="new requests (prompt, sampling, blocks)")
    ax.set_xlabel("engine step")
    ax.set_ylabel("message size (bytes, pickled)")
    ax.set_title("The plan as a message: what the scheduler sends each step, beside what the runner holds")
    held = [sum(s.num_computed_tokens + s.num_scheduled_tokens for s in r.seqs) for r in records[:len(sizes)]]
    twin = ax.twinx()
    twin.plot(range(len(held)), held, color="#54A24B", marker=".", label="context held by the runner (tokens)")
    twin.set_ylabel("tokens held in the runner's batch")
    twin.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", fontsize=8)
    return [n + r for n, r in sizes]
