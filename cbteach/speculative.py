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

from .request import check_positive_int


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
    """Greedy guesses from a smaller causal LM that shares the target's vocabulary."""

    def __init__(self, draft_model, num_speculative_tokens: int):
        check_positive_int("num_speculative_tokens", num_speculative_tokens)
        self.model, self.k = draft_model.eval(), num_speculative_tokens
        self.device = next(draft_model.parameters()).device

    @torch.inference_mode()
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, len(token_ids):].tolist()


def make_proposer(speculative, num_speculative_tokens: int):
    """``None``, ``"ngram"``, or a draft model (a transformers causal LM)."""
    if speculative is None:
        return None
    if speculative == "ngram":
        return NgramProposer(num_speculative_tokens)
    if hasattr(speculative, "generate") and hasattr(speculative, "parameters"):
        return DraftModelProposer(speculative, num_speculative_tokens)
    raise ValueError(f"speculative must be None, 'ngram' or a draft model, got {speculative!r}")


def accept(drafts: list[int], targets: list[int]) -> list[int]:
    """Greedy verification: ``targets[j]`` is the model's token after draft ``j`` (``targets[0]``
    after the last real token). Returns the tokens the step yields: the accepted drafts, then the
    model's own token at the first mismatch (or after the last draft)."""
    out = []
    for d, t in zip(drafts, targets):
        out.append(t)
        if d != t:
            return out
    out.append(targets[len(drafts)])
    return out


def propose_for(running, proposer) -> None:
    """Guesses for every greedy, decoding sequence -- never more than it may still emit."""
    for seq in running:
        room = seq.request.max_new_tokens - len(seq.output_ids) - 1
        if seq.output_ids and seq.num_computed_tokens == seq.num_tokens - 1 and room > 0 \
                and seq.request.sampling_params.greedy:
            k = min(proposer.k, room)
            seq.draft_ids = proposer.propose(seq.token_ids(0, seq.num_tokens), k)[:k]


def count_speculation(stats: dict, record) -> None:
    """Add one step's guesses and acceptances to ``stats`` (``drafted``, ``accepted``, ``verify_steps``)."""
    for s in record.seqs:
        if s.num_draft_tokens:
            stats["drafted"] += s.num_draft_tokens
            stats["accepted"] += len(s.new_token_ids) - 1
            stats["verify_steps"] += 1
