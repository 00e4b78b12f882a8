"""Choosing the next token (:func:`sample`) and deciding when a request is done (:func:`stop_reason`),
shared by every batcher. The course decodes greedily by default, so that output can be checked token for
token against ``model.generate``; a seeded request draws from its own ``torch.Generator``, so its tokens
do not depend on who else is in the batch.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-40 overflows.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (a few of vLLM's ``SamplingParams``). ``temperature`` below
    :data:`GREEDY_BELOW` (the default, 0) is greedy: argmax."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1  # samples of one prompt (sample i draws from seed + i; the engine option says how they share blocks)
    stop_token_ids: tuple = ()  # more ids that end the request (finish_reason "stop"), even with ignore_eos

    def __post_init__(self):
        if not isinstance(self.n, numbers.Integral) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {self.n!r}")
        t, p = self.temperature, self.top_p
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(p, numbers.Real) or isinstance(p, bool) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        # A Fraction or a NumPy number is a valid value; torch divides by floats.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        ids = getattr(self.stop_token_ids, "tolist", lambda: self.stop_token_ids)()  # (an array or a tensor: a list)
        if not isinstance(ids, (str, bytes, dict)) and hasattr(ids, "__iter__"):
            ids = tuple(ids)  # (once: a generator or an iterator is read here, and only here)
        if not isinstance(ids, tuple) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64) (what torch.Generator takes), "
                             f"got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


GREEDY = SamplingParams()


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list | None = None) -> list[int]:
    """One token per row of ``logits`` ``[num_requests, vocab]``: greedy rows by one ``argmax``, the
    others one by one -- temperature, then top-p filtering, then a draw from the row's generator."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
            drop[0] = False  # the most likely token is always kept (a top_p below float32's range would drop it)
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        gen = generators[i] if generators is not None else None
        tokens[i] = int(torch.multinomial(probs.cpu(), 1, generator=gen))
    return tokens


def make_generator(params: SamplingParams, sample_index: int = 0) -> torch.Generator | None:
    """A CPU generator for a seeded request (None: the global RNG); sample ``i`` of ``n`` draws from ``seed + i``."""
    if params.seed is None:
        return None
    seed = int(params.seed) + sample_index
    return torch.Generator().manual_seed(seed - 2**64 if seed >= 2**64 else seed)


def stop_reason(output_ids: list[int], max_new_tokens: int, eos_ids, ignore_eos: bool = False,
                stop_token_ids=()) -> str | None:
    """``"eos"``, ``"stop"`` (one of ``stop_token_ids``), ``"length"`` or ``None`` (keep going) after the
    last token was appended (V1's ``check_stop``; stop strings are text, checked where it is detokenized)."""
    if output_ids and output_ids[-1] in eos_ids and not ignore_eos:
        return "eos"
    if output_ids and output_ids[-1] in stop_token_ids:
        return "stop"
    if len(output_ids) >= max_new_tokens:
        return "length"
    return None
