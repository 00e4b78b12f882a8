"""The two messages of a step: the scheduler's plan to the worker (vLLM V1's ``SchedulerOutput``,
``vllm/v1/core/sched/output.py``) and the worker's answer (V1's ``ModelRunnerOutput``, ``vllm/v1/outputs.py``).

The scheduler and the worker share no objects. The scheduler keeps the requests' live state
(:class:`~cbteach.core.request.Sequence`); the worker keeps its own copy of what it needs -- token ids,
block tables, sampling state -- in its **persistent batch** (:mod:`cbteach.worker.input_batch`), and
changes it only from this message and from the tokens it samples itself. So the message is plain data
(ids, ints, lists, frozen dataclasses; no tensor, no generator), it pickles, and it sends each request's
data once ("we only send the diff to minimize the communication cost", V1's ``output.py``):

* :class:`NewRequestData` -- a request the worker has never seen: prompt, sampling parameters, block ids,
  ``num_computed_tokens`` (past zero after a prefix-cache hit);
* :class:`CachedRequestData` -- requests the worker holds: only the blocks added since the last step and
  ``num_computed_tokens``. A request **resumed** after a preemption is flagged (``resumed_req_ids``) and
  gets its whole new table, and its token ids (``all_token_ids``) if it missed the step before. No other
  token ids: the worker appended the tokens it sampled itself;
* ``num_scheduled_tokens`` -- ``{request id: tokens fed this step}`` (never 0);
  ``scheduled_spec_decode_tokens`` -- V1's speculative tokens fed after the known ones;
* ``finished_req_ids`` -- requests the worker should forget. After the last step the engine sends one
  more message, with nothing scheduled, so that an idle worker holds no request.

cbteach's fields, not V1's: ``sample_index`` (sample ``i`` of a request with ``n > 1`` draws from
``seed + i``), ``output_token_ids`` and ``generator_state`` (a request handed over from another engine),
``replaced_req_ids`` (a table changed other than by appending), and ``admitted_req_ids`` for the step
record. :class:`RunnerOutput` comes back in the worker's row order: find a request's results through
``req_id_to_index``, as V1's ``update_from_output`` does.
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
    """Requests the worker already holds, as a diff. Entry ``i`` is request ``req_ids[i]``: its block
    table gets ``new_block_ids[i]`` appended -- or, for a request in ``resumed_req_ids`` (or
    ``replaced_req_ids``), becomes it."""

    req_ids: list = field(default_factory=list)
    resumed_req_ids: set = field(default_factory=set)  # back after a preemption (V1's name)
    replaced_req_ids: set = field(default_factory=set)  # cbteach's: the table changed other than by appending
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict = field(default_factory=dict)  # resumed and not scheduled in the step before: its tokens

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan, as sent to the worker (see the module)."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict = field(default_factory=dict)  # request id -> tokens fed now (>= 1)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict = field(default_factory=dict)  # request id -> guesses fed after its tokens
    finished_req_ids: frozenset = frozenset()
    admitted_req_ids: list = field(default_factory=list)  # for the step record
    preempted_req_ids: list = field(default_factory=list)

    @property
    def req_ids(self) -> list:
        """The scheduled requests, in the order they were planned (the worker packs them in the order of
        its batch's rows, and says which is which: ``RunnerOutput.req_id_to_index``)."""
        return list(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing for the worker to do: no tokens, nobody to forget."""
        return not (self.num_scheduled_tokens or self.finished_req_ids)

    def num_computed_tokens_of(self) -> dict:
        """``{request id: num_computed_tokens}`` where each scheduled request starts this step."""
        start = {r.req_id: r.num_computed_tokens for r in self.scheduled_new_reqs}
        start.update(zip(self.scheduled_cached_reqs.req_ids, self.scheduled_cached_reqs.num_computed_tokens))
        return start

    def record_fields(self) -> dict:  # what the engine's step record takes from the message
        return {"admitted": list(self.admitted_req_ids), "preempted": list(self.preempted_req_ids)}

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
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        """Schedule ``n`` tokens of ``seq`` from its ``num_computed_tokens`` on (its KV room is taken).
        (An entry for no tokens does not reach the message: V1's running loop skips such a request.)"""
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
                          prev_scheduled=frozenset(), cls=SchedulerOutput, **extra) -> SchedulerOutput:
    """The message for a planned step. ``sent_block_ids`` is the scheduler's record of the block table
    the worker holds for each request (``None``: the worker holds the request, but its blocks were
    taken back -- a preemption); it is brought up to date with what this message sends. A request with
    no record goes in whole (:class:`NewRequestData`); one with a record goes in as a diff
    (:class:`CachedRequestData`): the blocks appended since, or its whole table if it was resumed or the
    table changed otherwise -- with its token ids when it was resumed and not in ``prev_scheduled`` (the
    step before's requests). Each request's ``num_computed_tokens`` is read now -- before the plan
    counts as computed. ``cls`` and ``extra``: a message class with more fields, and their values."""
    new, cached = [], CachedRequestData()  # (its lists are filled here, before the message is sent)
    spec = {}
    planned = [(seq, n) for seq, n in zip(plan.seqs, plan.num_scheduled_tokens) if n > 0]
    for seq, n in planned:
        rid, table = seq.request_id, seq.block_table
        if rid not in sent_block_ids:
            new.append(NewRequestData(req_id=rid, prompt_token_ids=list(seq.prompt_ids),
                                      sampling_params=seq.request.sampling_params,
                                      sample_index=seq.sample_index or 0, block_ids=list(table),
                                      num_computed_tokens=seq.num_computed_tokens,
                                      output_token_ids=list(seq.output_ids), generator_state=seq.generator_state))
            sent_block_ids[rid] = list(table)
        else:
            sent = sent_block_ids[rid]
            cached.req_ids.append(rid)
            cached.num_computed_tokens.append(seq.num_computed_tokens)
            cached.num_output_tokens.append(len(seq.output_ids))
            if sent is None:  # back after a preemption: a new table, and its tokens if it missed the last step
                cached.resumed_req_ids.add(rid)
                if rid not in prev_scheduled:
                    cached.all_token_ids[rid] = seq.prompt_ids + seq.output_ids
            elif len(table) < len(sent) or table[:len(sent)] != sent:
                cached.replaced_req_ids.add(rid)
            if rid in cached.resumed_req_ids or rid in cached.replaced_req_ids:
                cached.new_block_ids.append(list(table))
                sent_block_ids[rid] = list(table)
            else:
                cached.new_block_ids.append(table[len(sent):])
                sent.extend(table[len(sent):])
        # Tokens past the known ones (and past any the step in flight will give it) are guesses.
        d = max(0, seq.num_computed_tokens + n - seq.num_tokens_with_placeholders)
        if d:
            spec[rid] = list(seq.draft_ids[:d])
    return cls(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached,
        num_scheduled_tokens={s.request_id: n for s, n in planned},
        total_num_scheduled_tokens=sum(n for _, n in planned), scheduled_spec_decode_tokens=spec,
        finished_req_ids=frozenset(finished_req_ids),
        admitted_req_ids=[s.request_id for s in plan.admitted], preempted_req_ids=[s.request_id for s in plan.preempted],
        **extra)


@dataclass
class RunnerOutput:
    """One step's results, per planned sequence ``i``:

    * ``sampled[i]`` -- its new token ids (one, or more when tokens fed on trust were accepted), or
      ``None`` for a prefill chunk that stopped short of its end;
    * ``errors[i]`` -- ``None``, or what went wrong for this sequence alone (a sampling error, a model
      error on its tokens): the scheduler ends it with ``finish_reason="error"``, its neighbours go on.
    """

    sampled: list
    req_ids: list = field(default_factory=list)  # whose results, in order (V1's ModelRunnerOutput.req_ids)
    req_id_to_index: dict = field(default=None)  # request id -> its index in these lists (from req_ids if None)
    forward_time: float = 0.0
    traffic: object = None  # the KV cache's KVTraffic for this step
    errors: list | None = None
    comm: dict | None = None  # a sharded model's collectives: {"all_reduces", "all_reduce_bytes", "num_tokens", "world_size"}
    forward_span: tuple | None = None  # (start, end) of the forward pass on time.perf_counter(), if kept

    def __post_init__(self):
        if len(self.req_ids) != len(self.sampled):
            raise ValueError(f"a RunnerOutput has one entry per request: {len(self.sampled)} sampled for "
                             f"{len(self.req_ids)} req_ids (say whose results they are: req_ids=[...])")
        if self.req_id_to_index is None:
            self.req_id_to_index = {rid: i for i, rid in enumerate(self.req_ids)}

    def error(self, i: int) -> str | None:
        return self.errors[i] if self.errors is not None else None

    @classmethod
    def empty(cls) -> RunnerOutput:
        """A step that ran nothing (the message only told the worker who finished, or moved blocks)."""
        return cls(sampled=[], req_ids=[])
