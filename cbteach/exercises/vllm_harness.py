"""The stage vLLM's own scheduler tests play on, rebuilt around cbteach's scheduler interface.

:class:`Harness` builds a scheduler and requests as vLLM's ``tests/v1/core/utils.py`` does and plays the
model runner and the engine core (made-up outputs, ``None`` for vLLM's "no token"); :func:`expect` is an
assertion that quotes vLLM's in V1's words.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.config import SchedulerConfig
from ..core.request import Request, RequestStatus, Sequence
from ..core.sampling import SamplingParams
from ..core.scheduler_output import CachedRequestData, RunnerOutput, SchedulerOutput
from ..kv.manager import KVCacheManager

VLLM_COMMIT = "003df2961dd8830c317a61f9745ccd557da9fa06"  # the newest vllm-project/vllm stored when ported
VLLM_FILE = "tests/v1/core/test_scheduler.py"
EOS_TOKEN_ID = 50256  # tests/v1/core/utils.py
NOW = 1000.0  # the harness's clock: after every arrival (V1's scheduler sees a request once it has arrived)


class VLLMAssertion(AssertionError):
    """One of vLLM's assertions did not hold for the scheduler under test; the message quotes it."""


def expect(vllm_says: str, got, want=True, here: str = "") -> None:
    """vLLM asserts ``vllm_says``; here it is ``got == want``. ``here``: what V1's names mean in cbteach."""
    if got != want:
        seen = "" if want is True else f" -- here {got!r}, not {want!r}"
        raise VLLMAssertion(f"vLLM asserts `{vllm_says}`{seen}{f' ({here})' if here else ''}")


def _returned(method: str, got, want: str, kind: type) -> None:
    if not isinstance(got, kind):
        raise VLLMAssertion(f"{method}() returned {type(got).__name__}, not {want}"
                            + (": not done yet?" if got is None else ""))


@dataclass
class Harness:
    """One scheduler of class ``cls``, as ``create_scheduler`` (or ``create_scheduler_with_priority``)
    builds vLLM's, and the engine's part of a step around it."""

    cls: type
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    num_blocks: int = 10000
    block_size: int = 16
    enable_prefix_caching: bool = False
    policy: str = "fcfs"
    steps: int = 0

    def __post_init__(self):
        config = SchedulerConfig(max_batch_size=self.max_num_seqs, token_budget=self.max_num_batched_tokens,
                                 policy=self.policy)
        self.kv = KVCacheManager(self.num_blocks - 1, self.block_size, prefix_caching=self.enable_prefix_caching)
        self.scheduler = self.cls(config, self.kv, eos_ids=frozenset({EOS_TOKEN_ID}))

    def create_requests(self, num_requests: int, num_tokens: int = 10, max_tokens: int = 16, stop_token_ids=(),
                        same_prompt: bool = False, req_ids=None, ignore_eos: bool = False, priorities=None,
                        arrival_times=None, starting_idx: int = 0) -> list[Sequence]:
        """Requests as ``tests/v1/core/utils.py`` makes them."""
        out = []
        for i in range(num_requests):
            at = arrival_times[i] if arrival_times else 0.0
            prompt = [starting_idx if same_prompt else i + starting_idx] * num_tokens
            request = Request(prompt, max_tokens, request_id=req_ids[i] if req_ids else f"{i + starting_idx}",
                              arrival_time=at, priority=priorities[i] if priorities else 0, ignore_eos=ignore_eos,
                              sampling_params=SamplingParams(stop_token_ids=tuple(stop_token_ids)))
            out.append(Sequence(request=request, prompt_ids=list(prompt), arrival_time=at))
        return out

    def add_request(self, *seqs: Sequence) -> list[Sequence]:
        for seq in seqs:
            self.scheduler.add(seq)
        return list(seqs)

    def finish_requests(self, seq: Sequence) -> None:
        """V1's ``finish_requests(id, FINISHED_...)``: the request ends where it is, its blocks freed."""
        self.scheduler.abort(seq)
        self.scheduler.forget(seq)

    def schedule(self) -> SchedulerOutput:
        self.steps += 1
        out = self.scheduler.schedule(NOW + self.steps)
        _returned("schedule", out, "the step's message (a SchedulerOutput)", SchedulerOutput)
        return out

    def update(self, out: SchedulerOutput, sampled: dict) -> list:
        """The runner's output for ``out``: ``sampled[request id]``, vLLM-style (``[]``: no token), for each
        request the message scheduled (V1 reads them by id, ``req_id_to_index``)."""
        ids = list(out.num_scheduled_tokens)
        tokens = [list(sampled[r]) if sampled.get(r) else None for r in ids]
        finished = self.scheduler.update_from_output(out, RunnerOutput(sampled=tokens, req_ids=ids), NOW + self.steps)
        _returned("update_from_output", finished, "the list of the requests that finished", (list, tuple))
        finished = list(finished)  # (a tuple is a list of them too: the engine core only iterates over it)
        for seq in [*finished, *(self.scheduler.requests.get(r) for r in ids)]:  # as the engine core does
            if seq is not None and seq.status.is_finished and seq.request_id in self.scheduler.requests:
                self.scheduler.forget(seq)
        return finished

    def update_draft_token_ids(self, req_ids, draft_token_ids) -> None:
        """Guesses for the next step, to decoding requests only (a prefill chunk's are ignored)."""
        for rid, drafts in zip(req_ids, draft_token_ids):
            seq = self.scheduler.requests.get(rid)
            if seq is not None and seq.is_decoding:
                seq.draft_ids = list(drafts)

    def running_after_schedule(self, seqs, spec: dict) -> SchedulerOutput:
        """``test_stop_via_update_from_output``'s set-up: every request running, its last token and guesses
        ``spec[id]`` scheduled (counted as computed, with their room, as ``update_after_schedule`` does)."""
        ids, starts, counts = [s.request_id for s in seqs], [s.num_tokens - 1 for s in seqs], {}
        for seq, start in zip(seqs, starts):
            seq.status, seq.draft_ids = RequestStatus.RUNNING, list(spec.get(seq.request_id, []))
            self.scheduler.requests[seq.request_id] = seq
            self.scheduler.running.append(seq)
            counts[seq.request_id] = n = 1 + len(seq.draft_ids)
            seq.num_computed_tokens = start
            self.kv.allocate_slots(seq, n)
            seq.num_computed_tokens += n
        cached = CachedRequestData(req_ids=ids, new_block_ids=[[] for _ in ids], num_computed_tokens=starts,
                                   num_output_tokens=[len(s.output_ids) for s in seqs])
        return SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens=counts,
                               total_num_scheduled_tokens=sum(counts.values()),
                               scheduled_spec_decode_tokens={r: list(g) for r, g in spec.items() if g})

    def ids(self, seqs) -> list:
        return [s.request_id for s in seqs]

    def counts(self, out: SchedulerOutput | None = None, name: str = "output", **want: int) -> None:
        """vLLM's usual counts, in its words, each ``== want[key]``: ``new`` and ``cached`` requests scheduled and
        ``finished`` ids in the step's message ``out`` (called ``name``); the scheduler's ``running``, ``waiting``."""
        said = {"running": ("len(scheduler.running)", len(self.scheduler.running)),
                "waiting": ("len(scheduler.waiting)", len(self.scheduler.waiting))}
        if out is not None:
            said.update(new=(f"len({name}.scheduled_new_reqs)", len(out.scheduled_new_reqs)),
                        cached=(f"{name}.scheduled_cached_reqs.num_reqs", len(out.scheduled_cached_reqs.req_ids)),
                        finished=(f"len({name}.finished_req_ids)", len(out.finished_req_ids)))
        for key, n in want.items():
            expect(f"{said[key][0]} == {n}", said[key][1], n)
