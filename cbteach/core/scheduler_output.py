"""What the scheduler hands the model runner: one step's plan, as a **message** (vLLM V1's ``SchedulerOutput``).

The scheduler and the model runner share no objects. The scheduler keeps the requests' live state
(:class:`~cbteach.core.request.Sequence`); the runner keeps its own copy of what it needs to run them
-- token ids, block tables, sampling state -- its **persistent batch**
(:mod:`cbteach.engine.input_batch`), and changes it only from this message. That is vLLM V1's
boundary (``vllm/v1/core/sched/output.py``; the runner's side is ``vllm/v1/worker/gpu_input_batch.py``),
and it is what lets the next step be planned while this one runs (async scheduling), and the same
message go to every tensor-parallel rank.

The message is plain data -- ids, ints, lists, frozen dataclasses; no ``Sequence``, no generator, no
tensor -- and it pickles. To keep it small it sends each request's data once:

* :class:`NewRequestData` -- a request the runner has never seen: its prompt, sampling parameters,
  block ids and ``num_computed_tokens`` (a prefix-cache hit starts past zero);
* :class:`CachedRequestData` -- requests the runner already holds: only what changed -- blocks added
  since the last step (or, when the table changed otherwise -- resumed after a preemption, a block
  copied on write, blocks trimmed -- the whole table), and ``num_computed_tokens``. No token ids: the
  runner appended the tokens it sampled itself. A running request's entry does not grow with its length;
* ``num_scheduled_tokens`` -- ``{request id: tokens fed this step}``, in the order they are packed;
  ``scheduled_spec_decode_tokens`` -- speculative guesses fed after the known tokens;
* ``finished_req_ids`` -- requests that finished or were aborted since the last message: the runner
  forgets them.

Two fields are cbteach's, not V1's: ``block_copies`` (copy-on-write copies the pool makes before the
forward pass, for PagedAttention's parallel sampling -- V1 has no copy on write) and ``scheduled_forks``
(samples that fork from a prompt this step, with their sample index). ``admitted_req_ids``,
``preempted_req_ids`` and ``swapped_in_req_ids`` are for the engine's step record; the runner ignores them.

While it plans, the scheduler keeps working notes with live sequences -- :class:`StepPlan`, V1's local
lists in ``schedule()`` -- and turns them into the message at the end (:func:`make_scheduler_output`,
through :meth:`~cbteach.engine.scheduler.Scheduler.make_output`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Sequence
from .sampling import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request scheduled for the first time: everything the runner keeps about it."""

    req_id: object
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    sample_index: int  # its seed is ``seed + sample_index`` (parallel sampling); 0 for a lone request
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)  # tokens it has already (a handed-over request's)
    generator_state: bytes | None = None  # a handed-over seeded request's random stream, to go on with


@dataclass(frozen=True)
class CachedRequestData:
    """Requests the runner already holds, as a diff. Entry ``i`` is request ``req_ids[i]``: its block
    table gets ``new_block_ids[i]`` appended -- or, where ``replace_block_ids[i]``, becomes it (V1's
    ``resumed_from_preemption``; cbteach also replaces after a copy on write or a trim)."""

    req_ids: list = field(default_factory=list)
    replace_block_ids: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan, as sent to the model runner (see the module)."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict = field(default_factory=dict)  # request id -> tokens fed now, in packed order
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict = field(default_factory=dict)  # request id -> guesses fed after its tokens
    finished_req_ids: frozenset = frozenset()
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy on write (src, dst), before the forward
    scheduled_forks: dict = field(default_factory=dict)  # request id -> [(sample id, sample index)] forking from it
    admitted_req_ids: list = field(default_factory=list)  # for the step record
    preempted_req_ids: list = field(default_factory=list)
    swapped_in_req_ids: list = field(default_factory=list)

    @property
    def req_ids(self) -> list:
        """The scheduled requests, in packed order."""
        return list(self.num_scheduled_tokens)

    def num_computed_tokens_of(self) -> dict:
        """``{request id: num_computed_tokens}`` where each scheduled request starts this step."""
        start = {r.req_id: r.num_computed_tokens for r in self.scheduled_new_reqs}
        start.update(zip(self.scheduled_cached_reqs.req_ids, self.scheduled_cached_reqs.num_computed_tokens))
        return start

    def num_draft_tokens(self, req_id) -> int:
        """Speculative guesses fed for ``req_id`` this step."""
        return len(self.scheduled_spec_decode_tokens.get(req_id, ()))

    def __repr__(self) -> str:
        parts = " ".join(f"{rid}:{n}" for rid, n in self.num_scheduled_tokens.items())
        return (f"SchedulerOutput({self.total_num_scheduled_tokens} tokens [{parts}], "
                f"{len(self.scheduled_new_reqs)} new, {len(self.scheduled_cached_reqs.req_ids)} cached"
                f"{f', finished={sorted(map(str, self.finished_req_ids))}' if self.finished_req_ids else ''})")


@dataclass
class StepPlan:
    """The scheduler's working notes while it plans one step (live sequences; never leaves the
    scheduler). ``seqs[i]`` feeds ``num_scheduled_tokens[i]`` tokens from its ``num_computed_tokens``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # recomputed later or swapped out
    swapped_in: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        """Schedule ``n`` tokens of ``seq`` from its ``num_computed_tokens`` on (its KV room is taken)."""
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(int(n))

    def remove(self, seq: Sequence) -> int:
        """Take ``seq`` out of the plan (it was preempted after being scheduled); returns its tokens."""
        if seq not in self.seqs:
            return 0
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        return self.num_scheduled_tokens.pop(i)


def make_scheduler_output(plan: StepPlan, sent_block_ids: dict, finished_req_ids=frozenset(),
                          block_copies=()) -> SchedulerOutput:
    """The message for a planned step. ``sent_block_ids`` is the scheduler's record of the block table
    the runner holds for each request; it is brought up to date with what this message sends. A
    request with no record goes in whole (:class:`NewRequestData`); one with a record goes in as a diff
    (:class:`CachedRequestData`): the blocks appended since, or its whole table if it changed otherwise.
    Each request's ``num_computed_tokens`` is read now -- before the plan counts as computed."""
    new, cached = [], CachedRequestData()  # (its lists are filled here, before the message is sent)
    spec, forks = {}, {}
    for seq, n in zip(plan.seqs, plan.num_scheduled_tokens):
        rid, table = seq.request_id, seq.block_table
        sent = sent_block_ids.get(rid)
        if sent is None:
            new.append(NewRequestData(req_id=rid, prompt_token_ids=list(seq.prompt_ids),
                                      sampling_params=seq.request.sampling_params,
                                      sample_index=seq.sample_index or 0, block_ids=list(table),
                                      num_computed_tokens=seq.num_computed_tokens,
                                      output_token_ids=list(seq.output_ids), generator_state=seq.generator_state))
        else:
            appended = len(table) >= len(sent) and table[:len(sent)] == sent
            cached.req_ids.append(rid)
            cached.replace_block_ids.append(not appended)
            cached.new_block_ids.append(table[len(sent):] if appended else list(table))
            cached.num_computed_tokens.append(seq.num_computed_tokens)
        sent_block_ids[rid] = list(table)
        # Tokens past the known ones (and past any the step in flight will give it) are guesses.
        d = max(0, seq.num_computed_tokens + n - seq.num_tokens_with_placeholders)
        if d:
            spec[rid] = list(seq.draft_ids[:d])
        if seq.forks:
            forks[rid] = [(f.request_id, f.sample_index) for f in seq.forks]
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached,
        num_scheduled_tokens={s.request_id: n for s, n in zip(plan.seqs, plan.num_scheduled_tokens)},
        total_num_scheduled_tokens=plan.total_num_scheduled_tokens, scheduled_spec_decode_tokens=spec,
        finished_req_ids=frozenset(finished_req_ids), block_copies=list(block_copies), scheduled_forks=forks,
        admitted_req_ids=[s.request_id for s in plan.admitted], preempted_req_ids=[s.request_id for s in plan.preempted],
        swapped_in_req_ids=[s.request_id for s in plan.swapped_in])
