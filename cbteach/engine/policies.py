"""Scheduling policies: the order in which waiting requests are admitted, and who is preempted.

A policy is a *waiting queue* that owns two decisions the scheduler leaves to it:

* **order** -- which waiting request is admitted next (the scheduler walks the queue in order);
* **victim** -- which running request gives up its KV blocks when memory runs out
  (:meth:`pick_victim`).

Two are built in, named as vLLM names them (``--scheduling-policy fcfs|priority``):

* :class:`FCFSQueue` -- first come, first served, by arrival time. A preempted request goes back
  to the *front* (it came first). The victim is the last of the running list -- the most recently
  admitted, usually the one with the least work to lose (vLLM V1 takes the same one).
* :class:`PriorityQueue` -- by ``Request.priority`` (smaller = more urgent, vLLM's convention),
  ties by arrival time. The victim is the least urgent running request, the latest to arrive
  among equals (as in vLLM V1). A preempted request goes back to its place by the same key, so it
  is ahead of everyone less urgent or later. An urgent *waiting* request that does not fit may
  also preempt less urgent running ones to get in (:meth:`~PriorityQueue.may_preempt`): that is
  vLLM V0's priority scheduling; V1 preempts only when a running request needs blocks.

Writing a policy is writing such a queue: subclass :class:`WaitingQueue` and define :meth:`key`
(smaller runs first), and optionally :meth:`pick_victim` and :meth:`may_preempt` -- the scheduler,
the invariants and the exactness tests stay the same. The key is read when a request is queued,
so a key that should change with time (aging) must be written as a fixed quantity, for example
``arrival_time + priority * seconds_per_level``.
"""
from __future__ import annotations

from ..core.request import RequestStatus, Sequence


class WaitingQueue:
    """Waiting requests kept sorted by :meth:`key` (stable for equal keys)."""

    name = "base"

    def __init__(self):
        self._items: list[Sequence] = []

    def key(self, seq: Sequence):
        """Smaller keys are admitted first. Subclasses decide."""
        raise NotImplementedError

    def add(self, seq: Sequence) -> None:
        k = self.key(seq)
        i = len(self._items)
        while i > 0 and self.key(self._items[i - 1]) > k:  # stable: after everyone with an equal key
            i -= 1
        self._items.insert(i, seq)

    def readd_preempted(self, seq: Sequence) -> None:
        """Put a preempted request back. By default, in its place by key."""
        self.add(seq)

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        """The running request to preempt: by default the one this policy would admit last."""
        return max(reversed(running), key=self.key)  # reversed: among equal keys, the newest

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        """May ``waiting``, which does not fit, take ``running``'s KV blocks to get in? By default no:
        a waiting request waits for room (FCFS never preempts to admit)."""
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
        """An urgent arrival may preempt strictly less urgent running requests (under memory pressure)."""
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
