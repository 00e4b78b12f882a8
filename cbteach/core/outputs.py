"""What a step's forward pass gives back to the scheduler (vLLM V1's ``ModelRunnerOutput``).

The worker's model runner fills one :class:`RunnerOutput` per step; the scheduler's
``update_from_output(scheduler_output, output, now)`` turns it into request state. Every list is in
the order of ``req_ids`` -- the worker's batch rows, the order it packed them in, which need not be
the order the scheduler planned them: find a request's results through ``req_id_to_index``, as V1's
``update_from_output`` does. It holds token ids, counts and error texts -- nothing that needs the
model's device.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
