"""Speculative decoding inside the continuous batch: guess k tokens cheaply, check them in one pass.

A decode step computes one token per sequence, however idle the hardware is. Speculative decoding
(Leviathan et al., 2023; Chen et al., 2023) lets a cheap *proposer* guess the next ``k`` tokens;
the model then runs the sequence's last token **plus the k guesses** in the same forward pass --
in a packed batch that is simply a sequence with ``1 + k`` queries, which the ragged packing and
the block-diagonal causal mask already express. With greedy decoding the check is exact:

* the model's argmax after the last token is ``t0``; after guess ``d1`` it is ``t1``; ...
* guesses are accepted while they equal what the model would have produced (``d1 == t0``,
  ``d2 == t1``, ...); at the first mismatch the model's own token is kept instead;
* so a step yields ``accepted + 1`` tokens, all of them exactly the tokens plain greedy decoding
  gives -- and the K/V written for rejected guesses are simply forgotten (``num_computed_tokens``
  stops before them, and blocks holding only them go back to the pool).

Two proposers:

* :class:`NgramProposer` -- *prompt lookup* (vLLM's ``ngram`` method): find the sequence's last
  few tokens earlier in its own text and propose what followed them there. No second model;
  it pays off on repetitive text (code, quotes, lists, templates).
* :class:`DraftModelProposer` -- a smaller model of the same tokenizer guesses greedily.
"""
from __future__ import annotations

import torch

from ..core.model_view import model_view
from ..core.modelinfo import check_weights, max_positions
from ..core.validation import check_positive_int
from ..worker.spec_runner import accept  # noqa: F401  (the verification runs in the worker; re-exported here)
from .scheduler import Scheduler


class NgramProposer:
    """Propose the ``k`` tokens that followed the latest earlier occurrence of the last n-gram."""

    def __init__(self, num_speculative_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
        check_positive_int("num_speculative_tokens", num_speculative_tokens)
        self.k, self.max_ngram, self.min_ngram = num_speculative_tokens, max_ngram, min_ngram

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(token_ids) <= n:
                continue
            tail = token_ids[-n:]
            for start in range(len(token_ids) - n - 1, -1, -1):  # latest earlier occurrence first
                if token_ids[start:start + n] == tail:
                    return token_ids[start + n:start + n + k]
        return []


class DraftModelProposer:
    """Greedy guesses from a smaller causal LM that shares the target's vocabulary.

    Kept simple on purpose: each step, for each sequence, the draft model runs ``generate`` over the
    sequence's whole context with no KV cache kept between steps and no batching across sequences,
    so proposing costs more as contexts grow. vLLM keeps the draft model's KV cache paged alongside
    the target's and drafts for the whole batch at once; the speed-ups measured here understate
    what such a proposer reaches (the acceptance rates do not depend on it).
    """

    def __init__(self, draft_model, num_speculative_tokens: int):
        check_positive_int("num_speculative_tokens", num_speculative_tokens)
        self.model, self.k = model_view(draft_model), num_speculative_tokens  # eval mode, the draft left as it is
        self.device = next(draft_model.parameters()).device
        self.vocab_size = draft_model.get_input_embeddings().num_embeddings
        self.max_positions = max_positions(draft_model.config)

    @torch.inference_mode()
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        if self.max_positions is not None:  # the draft may be shorter-lived than the target: guess less, or not at all
            k = min(k, self.max_positions - len(token_ids))
        if k < 1:
            return []
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, len(token_ids):].tolist()


def make_proposer(speculative, num_speculative_tokens: int, vocab_size: int | None = None):
    """``None``, ``"ngram"``, or a draft model (a transformers causal LM with the target's
    ``vocab_size`` token ids: its guesses are fed to the target as they are)."""
    check_positive_int("num_speculative_tokens", num_speculative_tokens)
    if speculative is None:
        return None
    if isinstance(speculative, str) and speculative == "ngram":
        return NgramProposer(num_speculative_tokens)
    if hasattr(speculative, "generate") and hasattr(speculative, "parameters"):
        check_weights(speculative, "the draft model")
        proposer = DraftModelProposer(speculative, num_speculative_tokens)
        if vocab_size is not None and proposer.vocab_size != vocab_size:
            raise ValueError(f"the draft model has {proposer.vocab_size} token ids and the model {vocab_size}: a draft "
                             "model must share the model's vocabulary (the same tokenizer)")
        return proposer
    if isinstance(speculative, str):
        raise ValueError(f"speculative must be None, 'ngram' or a draft model, got {speculative!r}: for a draft model "
                         "by name, the engine takes the model itself, loaded (speculative=cbteach.load_model(name)[0]); "
                         "the command lines' --speculative loads a name for you")
    shown = (repr(speculative).splitlines() or [""])[0][:80]  # (a module's repr is its whole tree)
    raise ValueError(f"speculative must be None, 'ngram' or a draft model (a causal LM, with generate), got "
                     f"{type(speculative).__name__} {shown}")


def propose_for(running, proposer) -> None:
    """Guesses for every greedy, decoding sequence -- never more than it may still emit."""
    for seq in running:
        room = seq.request.max_new_tokens - len(seq.output_ids) - 1
        if seq.is_decoding and room > 0 and seq.request.sampling_params.greedy:
            k = min(proposer.k, room)
            seq.draft_ids = proposer.propose(seq.token_ids(0, seq.num_tokens), k)[:k]


def num_accepted(new_token_ids: list[int], guesses: list[int]) -> int:
    """Guesses kept by a verify step that appended ``new_token_ids``: their common start with the guesses
    fed (the model's own token after them differs from the guess there, or follows the last one; a stop
    may cut the step short)."""
    return next((j for j, (a, b) in enumerate(zip(new_token_ids, guesses)) if a != b),
                min(len(new_token_ids), len(guesses)))


class SpeculatingScheduler(Scheduler):
    """A scheduler whose running requests guess before each step (see the module). The guesses ride in
    the scheduler's own planning -- V1 threads them through its scheduler the same way
    (``num_tokens_with_spec``, ``scheduled_spec_decode_tokens``) -- so any scheduler can carry them;
    this adds who guesses (``proposer``) and the count of guesses fed and kept (``spec_stats``)."""

    proposer = None  # an NgramProposer or a DraftModelProposer (set by speculating())

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spec_stats = {"drafted": 0, "accepted": 0, "verify_steps": 0}

    def schedule(self, now: float):
        """Guesses first, then the scheduler's own plan."""
        propose_for(self.running, self.proposer)
        return super().schedule(now)

    def update_from_output(self, scheduler_output, output, now: float) -> list:
        """As the scheduler's own, counting each verify step's guesses, fed and kept."""
        guessed = [(self.requests[rid], len(self.requests[rid].output_ids), guesses)
                   for rid, guesses in scheduler_output.scheduled_spec_decode_tokens.items() if rid in self.requests]
        finished = super().update_from_output(scheduler_output, output, now)
        for seq, before, guesses in guessed:
            self.spec_stats["drafted"] += len(guesses)
            self.spec_stats["accepted"] += num_accepted(seq.output_ids[before:], guesses)
            self.spec_stats["verify_steps"] += 1
        return finished


def speculating(scheduler_cls: type, proposer) -> type:
    """``scheduler_cls`` whose requests guess with ``proposer`` (:class:`SpeculatingScheduler`'s rules
    first: its ``schedule`` proposes, then runs ``scheduler_cls``'s)."""
    return type(f"Speculating{scheduler_cls.__name__}", (SpeculatingScheduler, scheduler_cls), {"proposer": proposer})
