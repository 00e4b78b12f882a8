"""Static batching: the baseline that continuous batching beats.

Requests are taken ``batch_size`` at a time. Each *wave* is left-padded to its longest prompt, run
through one prefill pass, then decoded one token per step **until its longest request is done**.
Only then does the next wave start -- the *batch barrier*. Two kinds of waste follow:

* **padding** -- in the prefill pass, a short prompt's row is filled with pad tokens so the batch
  is rectangular; the model computes them and throws them away;
* **idling** -- a request that hit EOS early keeps its slot, computing a throw-away token every step,
  until the slowest member of its wave finishes. Nobody can take the slot mid-wave.

Left padding (pads before the prompt) with a 2-D attention mask and ``position_ids`` counted from
each prompt's first real token is how ``generate`` batches too, so every request still gets the
tokens it would get alone (the tests check it token for token against per-prompt ``generate``). Each step is recorded slot by slot (:class:`StaticStep`), so the
waste can be counted and drawn.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..core import modelinfo
from ..core.model_view import model_view
from ..core.request import Completion, decode_text
from ..core.config import check_batch_size
from ..core.validation import as_request_list, validate_request
from ..core.sampling import make_generator, sample, stop_reason

SLOT_STATES = ("prefill", "decode", "idle", "empty")


@dataclass
class SlotStep:
    request_id: object  # None for a slot no request occupies in this wave
    state: str  # "prefill" | "decode" | "idle" (finished, waiting for the barrier) | "empty"
    num_tokens: int = 0  # useful tokens computed
    num_pad: int = 0  # padding (or throw-away) tokens computed


@dataclass
class StaticStep:
    step: int
    wave: int
    kind: str  # "prefill" or "decode"
    slots: list[SlotStep]
    start_time: float = 0.0
    duration: float = 0.0

    @property
    def num_useful(self) -> int:
        return sum(s.num_tokens for s in self.slots)

    @property
    def num_wasted(self) -> int:
        return sum(s.num_pad for s in self.slots)


class StaticResult(list):
    """The completions (a list, in request order) plus ``.steps``, the per-slot record of every step."""

    def __init__(self, completions, steps, batch_size):
        super().__init__(completions)
        self.steps: list[StaticStep] = steps
        self.batch_size = batch_size

    def waste(self) -> dict:
        """Slot-steps by state, and the fraction of computed tokens that were padding or idling."""
        counts = {s: 0 for s in SLOT_STATES}
        for st in self.steps:
            for slot in st.slots:
                counts[slot.state] += 1
        useful = sum(st.num_useful for st in self.steps)
        wasted = sum(st.num_wasted for st in self.steps)
        counts["useful_tokens"] = useful
        counts["wasted_tokens"] = wasted
        counts["wasted_fraction"] = wasted / (useful + wasted) if useful + wasted else 0.0
        return counts


@torch.inference_mode()
def static_batching(model, tokenizer, requests, batch_size: int, progress: bool = False) -> StaticResult:
    """Serve ``requests`` in waves of ``batch_size`` with a batch barrier; returns a :class:`StaticResult`."""
    check_batch_size("batch_size", batch_size)
    info = modelinfo.describe(model, tokenizer)
    modelinfo.check_takes_cache(info, "static batching")
    requests = as_request_list(requests, "static_batching()")
    prompts = [validate_request(r, tokenizer=tokenizer, vocab_size=info.vocab_size, max_pos=info.max_positions)
               for r in requests]
    several = [r.request_id for r in requests if r.sampling_params.n > 1]
    if several:
        raise ValueError(f"request {several[0]!r} asks for n > 1 samples; static batching runs one sample per request "
                         "(the Engine shares a prompt's KV blocks between samples)")
    ids = [r.request_id for r in requests]
    dup = sorted({str(i) for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"duplicate request_id(s) {dup}: every request needs its own id")
    pad_id = min(info.eos_ids) if info.eos_ids else 0
    t0 = time.perf_counter()
    steps: list[StaticStep] = []
    completions: list[Completion] = []
    waves = range(0, len(requests), batch_size)
    if progress:
        from tqdm.auto import tqdm

        waves = tqdm(waves, desc="waves", unit="wave")
    view = model_view(model)  # eval mode (dropout off) on a view: the model itself is left as it is
    for w, first in enumerate(waves):
        wave = slice(first, first + batch_size)
        completions += _run_wave(view, info, tokenizer, requests[wave], prompts[wave], w, batch_size, pad_id,
                                 t0, steps)
    return StaticResult(completions, steps, batch_size)


def _run_wave(model, info, tokenizer, reqs, prompts, wave, batch_size, pad_id, t0, steps) -> list[Completion]:
    """Prefill one left-padded wave, decode it until every request is done; append to ``steps``."""
    n = len(reqs)
    width = max(len(p) for p in prompts)
    rows = [[pad_id] * (width - len(p)) + p for p in prompts]
    input_ids = torch.tensor(rows, device=info.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=info.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    outputs: list[list[int]] = [[] for _ in range(n)]
    times: list[list[float]] = [[] for _ in range(n)]
    done = [None] * n  # finish reason per slot
    params = [r.sampling_params for r in reqs]
    generators = [make_generator(p) for p in params]
    kind = "prefill"
    while True:
        start = time.perf_counter() - t0
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                    use_cache=True, **{info.cache_kwarg: cache})
        next_tokens = sample(out.logits[:, -1], params, generators)
        now = time.perf_counter() - t0
        slots = []
        for i in range(batch_size):
            if i >= n:
                slots.append(SlotStep(None, "empty"))
            elif done[i]:
                slots.append(SlotStep(reqs[i].request_id, "idle", 0, 1))
            else:
                useful = len(prompts[i]) if kind == "prefill" else 1
                slots.append(SlotStep(reqs[i].request_id, kind, useful, input_ids.shape[1] - useful))
                outputs[i].append(next_tokens[i])
                times[i].append(now)
                done[i] = stop_reason(outputs[i], reqs[i].max_new_tokens, info.eos_ids, reqs[i].ignore_eos,
                                      reqs[i].sampling_params.stop_token_ids)
        steps.append(StaticStep(len(steps), wave, kind, slots, start, time.perf_counter() - t0 - start))
        if all(done):
            break
        # Decode: every row feeds one token -- its last sample, or a throw-away pad once it is done.
        kind = "decode"
        feed = [pad_id if done[i] else outputs[i][-1] for i in range(n)]
        input_ids = torch.tensor(feed, device=info.device)[:, None]
        mask = torch.cat([mask, torch.ones(n, 1, dtype=mask.dtype, device=info.device)], dim=1)
        # A finished row's throw-away token keeps its last position: it must not walk past the
        # model's positions (GPT-2's learned position table has only n_positions rows).
        positions = positions[:, -1:] + torch.tensor([[0 if d else 1] for d in done], device=info.device)
    texts = [decode_text(tokenizer, out) for out in outputs]  # (text, why it failed)
    return [Completion(
        request_id=r.request_id, prompt_ids=list(prompts[i]), output_ids=outputs[i],
        finish_reason="error" if texts[i][1] else done[i], text=texts[i][0], arrival_time=0.0,
        first_token_time=times[i][0], token_times=times[i], finish_time=times[i][-1], error=texts[i][1])
        for i, r in enumerate(reqs)]
