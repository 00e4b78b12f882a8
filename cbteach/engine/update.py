"""After the forward pass: the step's output becomes request state (vLLM V1's ``update_from_output``).

The scheduler already counted the planned tokens as computed when it planned the step
(:meth:`~cbteach.engine.scheduler.Scheduler.update_after_schedule`). What is left happens here, and
only here, for each planned sequence ``i``:

1. **guesses the model rejected are taken back** (V1 threads speculative decoding through here):
   ``num_computed_tokens`` goes down by them, and blocks that held only rejected guesses go back
   to the pool (``trim``; V1 keeps them with the request);
2. **sampled tokens are appended** (``output.sampled[i]``: one token, several when guesses were
   accepted, or ``None`` for a prefill chunk that stopped short of its prompt's end -- it gets
   nothing, and nothing is appended);
3. **stop checks** after every appended token: EOS (unless ``ignore_eos``), one of the request's
   ``stop_token_ids``, or ``max_new_tokens`` reached (:func:`~cbteach.core.sampling.stop_reason`).
   A stop inside accepted guesses drops the guesses after it. (Stop *strings* are text: vLLM V1
   checks them in the front end's detokenizer, and so does cbteach's server.)
4. **a finished sequence leaves**: out of ``running``, its KV blocks freed -- *after* its last token
   is recorded. Forgetting this is the leak every engine has had once.

A failure that belongs to one sequence alone (``output.errors[i]``: its sampling failed, or the model
failed on its tokens) ends that sequence with ``finish_reason="error"``; the others are updated as
usual.
"""
from __future__ import annotations

from ..core.outputs import RunnerOutput
from ..core.request import RequestStatus, Sequence
from ..core.sampling import stop_reason
from ..core.scheduler_output import SchedulerOutput


class UpdateFromOutput:
    """The second half of :class:`~cbteach.engine.scheduler.Scheduler` (it needs ``running``,
    ``kv_manager``, ``eos_ids`` and ``_start`` from there)."""

    def update_from_output(self, scheduler_output: SchedulerOutput, output: RunnerOutput, now: float) -> list[Sequence]:
        """Turn one step's ``output`` into request state (see the module). ``output``'s lists are in the
        order the worker packed the requests; each is found by its id (``output.req_id_to_index``, as
        V1's ``update_from_output`` does). Returns the sequences that finished on this step."""
        finished = []
        start = scheduler_output.num_computed_tokens_of()
        index = output.req_id_to_index
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            seq = self.requests.get(rid)
            if seq is None or seq.status.is_finished:  # stopped or aborted while this step was in flight: dropped (V1)
                continue
            i = index[rid]
            tokens = output.sampled[i]
            if output.error(i) is not None:
                self._fail(seq, output.error(i), finished, computed_before=start[rid])
                continue
            drafts = scheduler_output.num_draft_tokens(rid)
            if drafts:  # V1: the rejected guesses' K/V are forgotten; what they wrote will be overwritten
                seq.num_computed_tokens -= drafts - (len(tokens) - 1)
                self.kv_manager.trim(seq)  # cbteach's: blocks that held only rejected guesses go back (V1 keeps them)
            seq.draft_ids = []
            for token in tokens or ():  # None: a prefill chunk that did not reach the end of the known tokens
                if self._append(seq, token, now):  # a stop inside accepted guesses drops the guesses after it
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                    break
            # Only now are accepted guesses among the sequence's tokens: the prefix cache hashes a
            # block's tokens, so it must see them to make blocks they filled findable.
            self.kv_manager.on_computed(seq)
            if seq.finish_reason:
                self._finish(seq, finished)
        return finished

    def _append(self, seq: Sequence, token: int, now: float) -> bool:
        """Append a sampled token to ``seq``'s output; True when it stops the sequence."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_ids.append(token)
        seq.token_times.append(now)
        params = seq.request.sampling_params
        seq.finish_reason = stop_reason(seq.output_ids, seq.request.max_new_tokens, self.eos_ids,
                                        seq.request.ignore_eos, params.stop_token_ids)
        return seq.finish_reason is not None

    def _finish(self, seq: Sequence, finished: list) -> None:
        """``seq`` stopped: it leaves the batch, and its blocks go back -- after its last token is recorded.
        (A request preempted while its step was in flight may stop while waiting.)"""
        seq.status = RequestStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_manager.free(seq)
        self.forget(seq)
        finished.append(seq)

    def _fail(self, seq: Sequence, message: str, finished: list, computed_before: int) -> None:
        """The step failed for ``seq`` alone: it ends with ``finish_reason="error"`` (its blocks freed).
        Its count of computed tokens goes back to ``computed_before`` (the step's start) first: the
        blocks this step was to fill were made findable when they were allocated, their K/V may never
        have been written, and ``free`` drops from the prefix cache every block past the computed
        tokens -- no later prompt may reuse them."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, computed_before)
        seq.finish_reason, seq.error = "error", message
        seq.draft_ids = []
        self._finish(seq, finished)
