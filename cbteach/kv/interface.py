"""The two seams around the KV cache, declared: what the scheduler calls on a KV manager, and what
the engine and model runner call on a KV cache.

They are ``typing.Protocol``\\ s -- structural types: any object with these methods fits, nothing
has to inherit from them (the learner's manager in notebook 05 does not). Reading them is the
quickest way to see who may do what:

* the **scheduler** decides who gets room and never touches K/V memory: it talks to a
  :class:`KVManager` (block tables, a free list, prefix sharing);
* the **model runner** never decides anything about room: it asks the :class:`KVCache` for the
  step's attention metadata and forward arguments, runs the model, and lets the cache do what
  follows the forward pass;
* the **engine** builds both, checks a request fits before it is queued, and reports usage.

Implementations: :class:`~cbteach.kv.paged.PagedKVCache` with
:class:`~cbteach.kv.manager.KVCacheManager` (PagedAttention; :class:`~cbteach.kv.fork.ForkingKVCacheManager`
adds fork and copy on write), and
:class:`~cbteach.kv.concat.ConcatKVCache` with :class:`~cbteach.kv.concat.UnboundedKVManager`.
vLLM V1 has the same split (``KVCacheManager`` for the scheduler, the model runner's KV tensors
and attention backends for the forward pass).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class KVManager(Protocol):
    """What :class:`~cbteach.engine.scheduler.Scheduler` calls: who owns which room."""

    def allocate_slots(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0):
        """Room for ``num_new_tokens`` more tokens of ``seq`` (past its ``num_computed_tokens``): the
        blocks added, or ``None`` -- with nothing changed -- when the pool cannot give it. A refusal
        is what makes the scheduler preempt (vLLM V1). The scheduler passes the two optional
        arguments only when they are not empty: an admission's prefix-cache hits (taken only if the
        room is given), and V0's whole-prompt reservation. A manager without prefix caching or V0's
        rule can take just ``(seq, num_new_tokens)``."""

    def free(self, seq) -> None:
        """Give back everything ``seq`` holds (finished, aborted or preempted)."""

    def trim(self, seq) -> None:
        """Give back room past ``seq``'s computed tokens (rejected speculative guesses)."""

    def num_admittable_tokens(self, seq, new_computed_blocks=()) -> float:
        """Tokens ``seq`` could be given now, keeping any admission watermark (V0 admission, swap-in).
        ``new_computed_blocks`` (passed only when not empty): an admission's prefix-cache hits, which
        cost no room where another sequence holds them."""

    def num_freeable_tokens(self, seqs) -> float:
        """Room that freeing every sequence in ``seqs`` would make (priority preemption's check)."""

    def get_computed_blocks(self, seq) -> tuple:
        """Prefix caching: ``(blocks, num_tokens)`` of a new ``seq``'s longest cached prefix; takes nothing."""

    def on_admitted(self, seq) -> None:
        """``seq`` was admitted (prefix-cache hit statistics)."""

    def on_computed(self, seq) -> None:
        """After a step: ``seq``'s accepted speculative guesses may have filled blocks (prefix caching)."""

    def check_fits(self, num_tokens: int, request_id) -> None:
        """Raise ``ValueError`` if a request of ``num_tokens`` could never fit, even alone."""

    def usage(self) -> dict:
        """The bookkeeping now: blocks, tokens stored, utilisation, block tables."""


@runtime_checkable
class ForkingKVManager(KVManager, Protocol):
    """A manager that can run ``parallel_sampling="fork"`` (PagedAttention's, vLLM V0's; V1 has no fork)
    also has these two, and says ``copy_on_write = True``
    (:class:`~cbteach.kv.fork.ForkingKVCacheManager`)."""

    copy_on_write: bool

    def fork(self, parent, child) -> None:
        """Parallel sampling: ``child`` starts on ``parent``'s room, shared (copy on write)."""

    def take_pending_copies(self) -> list:
        """Copy-on-write ``(src, dst)`` block copies the pool must make before the next forward pass."""


@runtime_checkable
class KVCache(Protocol):
    """What :class:`~cbteach.engine.engine.Engine` and the worker's :class:`~cbteach.worker.model_runner.ModelRunner` call."""

    kind: str  # "concat" or "paged"
    manager: KVManager  # handed to the scheduler
    attn_implementation: str | None  # the attention function the engine's model view must call (None: the model's)

    def build_metadata(self, token_ids, num_computed, num_scheduled, device, block_tables=None, num_blocks=None,
                       request_ids=()):
        """The step's :class:`~cbteach.attention.metadata.AttentionMetadata`, built once per step from the
        worker's own rows: their block tables (paged: lists, or the batch's block-table array with
        ``num_blocks`` per row) or their ids (concat)."""

    def forward_kwargs(self, meta) -> dict:
        """Extra arguments for the model's forward pass (past K/V and a mask, or the metadata)."""

    def after_forward(self, meta):
        """Whatever follows the forward pass (concat scatters new K/V); returns the step's ``KVTraffic``."""

    def usage(self) -> dict:
        """Usage now, for :meth:`Engine.kv_usage`."""


@runtime_checkable
class Swapper(Protocol):
    """A pool that can move a request's blocks to host memory and back (V0's swap preemption; a
    handover): the worker's side -- the scheduler only says which blocks (``V0SchedulerOutput``)."""

    def swap_out_blocks(self, req_id, blocks: list[int]) -> None: ...

    def swap_in_blocks(self, req_id, blocks: list[int]) -> None: ...

    def discard(self, req_id) -> None: ...
