"""The continuous-batching engine: iteration-level scheduling + ragged packing, one step at a time.

One call to :meth:`Engine.step` is one forward pass of the model:

1. the :class:`~cbteach.scheduler.Scheduler` picks who runs and how many tokens each feeds --
   sequences that finished last step are gone, queued requests fill their slots (Orca);
2. :func:`~cbteach.packing.pack` concatenates those tokens into one ``[1, total_tokens]`` row with
   per-sequence ``position_ids`` -- a new prompt's whole prefill beside other sequences' one-token
   decodes, no padding;
3. the KV cache (``kv="concat"`` or ``kv="paged"``) supplies past keys and values and the
   block-diagonal causal mask, the model runs, and the new keys and values are stored;
4. each sequence that has now computed all its tokens samples its next token greedily from the
   logits at its last position, and leaves if that token is EOS or its ``max_new_tokens`` is reached.

Greedy decoding in fp32 gives token for token what per-prompt ``model.generate`` gives when the
model's ``generation_config`` asks for plain greedy search (no repetition penalty and the like,
which the engine does not implement and warns about); the tests check exactly that against
transformers. (Different packing changes fp32 rounding, so an exact tie between two logits could in
principle break the other way; the tests have never seen it.)
"""
from __future__ import annotations

import time

import torch

from . import modelinfo
from .kv_concat import ConcatKVCache
from .packing import pack
from .records import SeqStep, StepRecord
from .request import Completion, Request, Sequence, validate_request
from .scheduler import Scheduler, check_batch_size, check_token_budget

KV_KINDS = ("concat", "paged")


class Engine:
    """A small continuous-batching inference engine over a transformers causal LM.

    ``Engine(model, tokenizer, max_batch_size=8)`` keeps the concatenating KV cache;
    ``kv="paged"`` (with ``block_size``, ``num_blocks`` or ``kv_memory_bytes``) uses the paged one.
    ``token_budget`` caps the tokens of one step; longer prompts are then prefilled in chunks.
    """

    def __init__(self, model, tokenizer=None, *, max_batch_size: int, kv: str = "concat", **policy):
        if kv not in KV_KINDS:
            raise ValueError(f"kv must be one of {KV_KINDS}, got {kv!r}")
        check_batch_size(max_batch_size)
        token_budget = policy.pop("token_budget", None)
        check_token_budget(token_budget)  # everything checked before the paged cache touches the model
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.info = modelinfo.describe(model, tokenizer)
        paged_args = {k: policy.pop(k) for k in ("block_size", "num_blocks", "kv_memory_bytes") if k in policy}
        if policy:
            raise ValueError(f"unknown engine option(s) {sorted(policy)}; allowed: token_budget, and with "
                             "kv='paged': block_size, num_blocks, kv_memory_bytes")
        if kv == "paged":
            from .kv_paged import PagedKVCache

            self.kv = PagedKVCache.for_model(model, self.info, max_batch_size=max_batch_size, **paged_args)
        else:  # paged-pool options are accepted and ignored, so one call can switch kv= back and forth
            self.kv = ConcatKVCache(self.info.num_layers, cache_kwarg=self.info.cache_kwarg)
        self.scheduler = Scheduler(max_batch_size, self.kv, token_budget=token_budget)
        self.records: list[StepRecord] = []
        self.completions: dict[object, Completion] = {}
        self.sequences: dict[object, Sequence] = {}  # every request ever added, by id
        self._t0: float | None = None

    # -- public API --------------------------------------------------------------------------
    def add_request(self, request: Request):
        """Validate and queue a request; returns its ``request_id``. Bad input raises ``ValueError``."""
        return self._enqueue(request, self._check(request))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def clock(self) -> float:
        """Seconds since the engine's first step."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        return time.perf_counter() - self._t0

    def kv_usage(self) -> dict:
        """The KV cache's state now (see :meth:`cbteach.kv_paged.PagedKVCache.usage`)."""
        return self.kv.usage()

    @torch.inference_mode()
    def step(self) -> StepRecord:
        """Run one forward pass over everything scheduled and return what happened."""
        start = self.clock()
        scheduled, admitted, preempted = self.scheduler.schedule(start)
        record = StepRecord(step=len(self.records), kv_kind=self.kv.kind, start_time=start,
                            admitted=[s.request_id for s in admitted],
                            preempted=[s.request_id for s in preempted])
        if scheduled:
            self._forward(scheduled, record)
        record.num_waiting = len(self.scheduler.waiting)
        record.kv_usage = self.kv.usage() if self.kv.kind == "paged" else None
        record.duration = self.clock() - start
        if scheduled:  # an idle step (waiting for arrivals) leaves no trace in the history
            self.records.append(record)
        return record

    def run(self, requests, progress: bool = False) -> list[Completion]:
        """Add ``requests``, step until all are done, and return their completions in request order.

        All requests are validated before any is queued, so a bad one raises ``ValueError`` and
        leaves the engine as it was.
        """
        requests = list(requests)
        taken: set = set()
        checked = []
        for r in requests:  # check them all before queuing any
            checked.append(self._check(r, taken))
            taken.add(r.request_id)
        for r, prompt_ids in zip(requests, checked):
            self._enqueue(r, prompt_ids)
        ours = {r.request_id for r in requests}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="requests", unit="req")
        while self.has_unfinished():
            record = self.step()
            if bar is not None:
                bar.update(sum(1 for rid in record.finished if rid in ours))
            if not record.seqs:
                self._wait_for_arrival()
        if bar is not None:
            bar.close()
        return [self.completions[r.request_id] for r in requests]

    # -- internals ---------------------------------------------------------------------------
    def _check(self, request, taken=()) -> list[int]:
        """Everything that can be wrong with a request, found before it touches the engine."""
        prompt_ids = validate_request(request, tokenizer=self.tokenizer, vocab_size=self.info.vocab_size,
                                      max_pos=self.info.max_positions)
        if request.request_id in self.sequences or request.request_id in taken:
            raise ValueError(f"duplicate request_id {request.request_id!r}: every request needs its own id")
        self.kv.check_fits(len(prompt_ids) + request.max_new_tokens, request.request_id)
        return prompt_ids

    def _enqueue(self, request: Request, prompt_ids: list[int]):
        seq = Sequence(request=request, prompt_ids=prompt_ids)
        self.sequences[request.request_id] = seq
        self.scheduler.add(seq)
        return request.request_id

    def _wait_for_arrival(self):
        nxt = self.scheduler.next_arrival()
        now = self.clock()
        if nxt is not None and nxt > now:  # nothing to do until the next request arrives
            time.sleep(nxt - now)

    def _forward(self, scheduled: list[tuple[Sequence, int]], record: StepRecord) -> None:
        seqs = [s for s, _ in scheduled]
        starts = [s.num_computed_tokens for s in seqs]
        chunks = [s.token_ids(c, c + n) for (s, n), c in zip(scheduled, starts)]
        batch = pack(chunks, starts, device=self.info.device)

        kwargs = self.kv.prepare(seqs, batch, self.info.dtype)
        last = batch.last_token_index
        if self.info.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = torch.tensor(last, device=self.info.device)
        t0 = time.perf_counter()
        with self.kv.forward_context(seqs, batch):
            out = self.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                             use_cache=self.kv.kind == "concat", **kwargs)
        record.forward_time = time.perf_counter() - t0
        self.kv.after_forward(seqs, batch)
        record.kv_bytes_copied = self.kv.last_copy.bytes_copied
        record.kv_copy_time = self.kv.last_copy.seconds

        logits = out.logits[0] if self.info.accepts_logits_to_keep else out.logits[0, last]
        next_tokens = logits.argmax(dim=-1).tolist()
        now = self.clock()
        for (seq, n), start, chunk, token in zip(scheduled, starts, chunks, next_tokens):
            decode = n == 1 and start == seq.num_tokens - 1 and bool(seq.output_ids)
            entry = SeqStep(request_id=seq.request_id, slot=seq.slot, kind="decode" if decode else "prefill",
                            num_cached=start, num_new=n, token_ids=chunk)
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:  # all known tokens computed: sample one more
                entry.sampled = token
                self._append_token(seq, token, now)
                entry.finish_reason = self._finish_reason(seq)
                if entry.finish_reason:
                    self._complete(seq, entry.finish_reason, now)
                    record.finished.append(seq.request_id)
            record.seqs.append(entry)

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.output_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)

    def _finish_reason(self, seq: Sequence) -> str | None:
        if seq.output_ids[-1] in self.info.eos_ids and not seq.request.ignore_eos:
            return "eos"
        if len(seq.output_ids) >= seq.request.max_new_tokens:
            return "length"
        return None

    def _complete(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq)
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        self.completions[seq.request_id] = Completion(
            request_id=seq.request_id, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids),
            finish_reason=reason, text=text, arrival_time=seq.request.arrival_time,
            first_token_time=seq.first_token_time, token_times=list(seq.token_times), finish_time=now)
