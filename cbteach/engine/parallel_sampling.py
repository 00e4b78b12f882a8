"""Parallel sampling: ``SamplingParams(n=k)`` asks for ``k`` samples of one prompt. Two designs:

* ``parallel_sampling="fanout"`` -- **vLLM V1's** (its ``ParentRequest``): the request becomes ``k``
  child requests -- ids ``(request_id, i)`` here, ``f"{i}_{request_id}"`` in V1 -- sample ``i``
  drawing from ``seed + i`` (V1's rule), each queued and
  scheduled like any request. What they share, they share through the **prefix cache**: with
  ``prefix_caching=True`` the first child's full prompt blocks become findable when they are
  allocated, so the other children -- even those admitted in the same step -- start past them. The
  prompt's last, partly filled block and everything after it is each child's own.
* ``parallel_sampling="fork"`` -- **PagedAttention's** (Kwon et al., SOSP'23, section 4.4; vLLM V0's
  sequence groups): sample 0 computes the prompt once, the others wait in its ``forks`` and, when
  its prefill ends, start *on its blocks* -- every block shared by reference count, the partly
  filled last one included -- each with its own first token drawn from the same logits. A shared
  block is copied only when a sample writes into it (copy on write). It needs a KV manager that
  copies on write (:func:`cbteach.kv.manager.can_fork`), and a batch slot for every sample at once.

Either way sample ``i`` gives what a request with ``seed + i`` gives alone, and the request's
:class:`~cbteach.core.request.Completion` gathers every sample's (``Completion.samples``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.request import Sequence


@dataclass(eq=False)
class ForkingSequence(Sequence):
    """A sequence of a request sampled by fork: the samples waiting in its ``forks`` share its blocks once
    its prefill ends, so its admission takes a batch slot for each of them too."""

    forks: list = field(default_factory=list)  # samples waiting for this one's prefill, to share its blocks

    @property
    def num_slots(self) -> int:
        return 1 + len(self.forks)


def make_samples(request, prompt_ids: list[int], arrival_time: float, claimed: bool, mode: str) -> list[Sequence]:
    """The sequences of ``request``: one, or one per sample; in fork mode the first holds the others
    in its ``forks``. Returns them all; :func:`queued` says which go to the waiting queue."""
    n = request.sampling_params.n
    cls = ForkingSequence if mode == "fork" else Sequence
    seqs = [cls(request=request, prompt_ids=prompt_ids, arrival_time=arrival_time, claimed=claimed,
                sample_index=None if n == 1 else i)
            for i in range(n)]
    if n > 1 and mode == "fork":
        seqs[0].forks = seqs[1:]
    return seqs


def queued(seqs: list[Sequence], mode: str) -> list[Sequence]:
    """Fanout queues every child; fork queues the one that computes the prompt."""
    return seqs if mode == "fanout" else seqs[:1]


def abort_sample(scheduler, seq: Sequence, group: list[Sequence]) -> None:
    """Abort one sample and only it (vLLM's rule: aborting the request id aborts them all). In fork
    mode a sample still computing the prompt hands the samples waiting on it to the next of them,
    which computes the prompt instead; a sample still waiting to fork just stops waiting."""
    if not isinstance(seq, ForkingSequence):
        scheduler.abort(seq)
        return
    waiting_on_it, seq.forks = seq.forks, []
    if waiting_on_it:
        heir = waiting_on_it[0]
        heir.forks = waiting_on_it[1:]
        scheduler.add(heir)
    for other in group:
        if seq in other.forks:
            other.forks.remove(seq)
    scheduler.abort(seq)
