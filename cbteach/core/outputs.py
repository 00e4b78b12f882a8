"""What a step's forward pass gives back to the scheduler (vLLM V1's ``ModelRunnerOutput``).

The model runner fills one :class:`RunnerOutput` per step; the scheduler's
``update_from_output(scheduler_output, output, now)`` turns it into request state. Every list is in
the order of ``req_ids`` -- the step's ``num_scheduled_tokens``, in packed order.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunnerOutput:
    """One step's results, per planned sequence ``i``:

    * ``sampled[i]`` -- its new token ids (one; more after speculative decoding: the accepted
      guesses and one of its own), or ``None`` for a prefill chunk that stopped short of its end;
    * ``fork_tokens[i]`` -- ``{sample id: first token}`` of the samples forking from it
      (``parallel_sampling="fork"``), or ``None``;
    * ``errors[i]`` -- ``None``, or what went wrong for this sequence alone (a sampling error, a model
      error on its tokens): the scheduler ends it with ``finish_reason="error"``, its neighbours go on.
    """

    sampled: list
    req_ids: list = field(default_factory=list)  # whose results, in order (V1's ModelRunnerOutput.req_ids)
    chunks: list = field(default_factory=list)  # the token ids each fed (guesses included), for records
    forward_time: float = 0.0
    traffic: object = None  # the KV cache's KVTraffic for this step
    fork_tokens: list | None = None
    errors: list | None = None
    comm: dict | None = None  # tensor parallelism: {"all_reduces", "all_reduce_bytes", "num_tokens", "world_size"}

    def error(self, i: int) -> str | None:
        return self.errors[i] if self.errors is not None else None
