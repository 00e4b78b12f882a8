"""Scheduling policies: a policy is the waiting queue, and owns two decisions the scheduler leaves to it.

* **order** -- which waiting request is admitted next (the scheduler walks the queue in order);
* **victim** -- which running request gives up its KV blocks when room runs out (:meth:`pick_victim`).

Two are built in, named as vLLM names them (``--scheduling-policy fcfs|priority``). :class:`FCFSQueue`:
arrival order, a preempted request back at the front, the last of the running list the victim (V1 pops
the same one). :class:`PriorityQueue`: smaller ``Request.priority`` first, ties by arrival; the victim is
the least urgent running request, the latest to arrive among equals (as in V1). A policy of your own
subclasses :class:`WaitingQueue` and defines :meth:`~WaitingQueue.key` (read once, when a request is
queued: an aging key must be a fixed quantity, e.g. ``arrival_time + priority * seconds_per_level``).
"""
from __future__ import annotations

from ..core.request import RequestStatus, Sequence


class WaitingQueue:
    """Waiting requests kept sorted by :meth:`key` (stable for equal keys)."""

    name = "base"

    def __init__(self):
        self._items: list[Sequence] = []

    def key(self, seq: Sequence):
        """Smaller keys are admitted first."""
        raise NotImplementedError

    def add(self, seq: Sequence) -> None:
        k = self.key(seq)
        i = len(self._items)
        while i > 0 and self.key(self._items[i - 1]) > k:  # stable: after everyone with an equal key
            i -= 1
        self._items.insert(i, seq)

    def readd_preempted(self, seq: Sequence) -> None:
        """By default, in its place by key."""
        self.add(seq)

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        """The running request to preempt: by default the one this policy would admit last."""
        return max(reversed(running), key=self.key)  # reversed: among equal keys, the newest

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        """May ``waiting``, which does not fit, take ``running``'s blocks to get in? By default no."""
        return False

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __contains__(self, seq) -> bool:
        return seq in self._items


class FCFSQueue(WaitingQueue):
    """First come, first served; preempted requests go back to the front; the newest is the victim."""

    name = "fcfs"

    def key(self, seq: Sequence):
        return seq.arrival_time

    def add(self, seq: Sequence) -> None:
        i = len(self._items)
        # Preempted requests were put at the front on purpose: never queue ahead of them.
        while i > 0 and self._items[i - 1].arrival_time > seq.arrival_time \
                and self._items[i - 1].status is RequestStatus.WAITING:
            i -= 1
        self._items.insert(i, seq)

    def readd_preempted(self, seq: Sequence) -> None:
        self._items.insert(0, seq)

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        return running[-1]  # the most recently admitted


class PriorityQueue(WaitingQueue):
    """Smaller ``priority`` first, then earlier arrival; the least urgent, latest arrival is the victim."""

    name = "priority"

    def key(self, seq: Sequence):
        return (seq.request.priority, seq.arrival_time)

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        """Only a strictly less urgent running request."""
        return running.request.priority > waiting.request.priority


POLICIES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def make_queue(policy) -> WaitingQueue:
    """``"fcfs"``, ``"priority"``, or a :class:`WaitingQueue` subclass or instance of your own."""
    if isinstance(policy, WaitingQueue):
        return policy
    if isinstance(policy, type) and issubclass(policy, WaitingQueue):
        return policy()
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise ValueError(f"policy must be one of {sorted(POLICIES)} or a cbteach.engine.policies.WaitingQueue, got {policy!r}")
