"""Before a paged pool is sized: one token through the model, to see what its layers hand their attention function.

The paged cache swaps the attention function a model's layers call (:mod:`cbteach.attention.paged`), and that
is exact only when every layer calls it **once per forward pass**, with this step's keys and values, **no mask
of its own** and **no extra term**. A config does not always say so, nor how wide the keys really are:

* DiffLlama's differential attention calls it twice per layer, with two halves of the values: the second
  call would overwrite the first one's values in the pool;
* Doge passes a learned mask of its own (its "dynamic mask"), which attention over block tables would drop;
* Gemma-2's logit soft-capping (``softcap=``) and GPT-OSS's attention sinks (``s_aux=``) are terms the
  engine's attention does not have;
* a layer that does not pass the forward's keyword arguments on (Nemotron) never gets the step's metadata;
* JetMoE's keys have more heads than ``config.num_key_value_heads`` says; GPTBigCode's config can disagree
  with its layers, as can a config that carries a ``num_key_value_heads`` its model ignores.

So :func:`paged_shape` runs one token through a view of the model (:mod:`cbteach.core.model_view`: the
model itself is not touched, its forward hooks do not fire) whose attention function only records what each
layer hands it, and returns the pool's shape as the layers use it -- or refuses the model, naming why.
"""
from __future__ import annotations

import dataclasses

import torch

NAME = "cbteach_probe"
KWARG = "cbteach_probe"  # the forward argument that carries the recorder
EXTRA_TERMS = ("softcap", "s_aux")  # arguments that change the scores, which the paged attention does not apply


@dataclasses.dataclass
class Call:
    """What one layer handed its attention function (keys ``[1, kv_heads, T, head_dim]``)."""

    layer: int | None
    module: str
    key_shape: tuple
    value_shape: tuple
    has_mask: bool
    extra_terms: list


def _record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    calls = kwargs.get(KWARG)
    if calls is not None:
        calls.append(Call(getattr(module, "layer_idx", None), type(module).__name__, tuple(key.shape),
                          tuple(value.shape), attention_mask is not None,
                          [k for k in EXTRA_TERMS if kwargs.get(k) is not None]))
    _, heads, tokens, _ = query.shape
    return query.new_zeros(1, tokens, heads, value.shape[-1]), None  # [1, T, heads, value head_dim], as attention returns


def record_calls(model) -> list[Call]:
    """Every call of the attention function in one forward pass of one token (``[]``: the layers
    dropped the recorder on the way; the model's own errors propagate)."""
    from transformers import AttentionInterface

    from ..core.model_view import model_view

    AttentionInterface.register(NAME, _record)
    view = model_view(model, NAME, share_hooks=False)
    device = next(model.parameters()).device
    calls: list[Call] = []
    try:
        with torch.inference_mode():
            view(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                 position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False, **{KWARG: calls})
    except TypeError as err:  # a forward without **kwargs: the step's metadata could not reach attention either
        if "unexpected keyword argument" not in str(err):
            raise
        raise ValueError(f"{type(model).__name__}'s forward does not take keyword arguments on to its attention "
                         f"function ({err}), so the paged cache's step metadata cannot reach it: use kv='concat'") from None
    return calls


def paged_shape(model, info):
    """``info`` (:class:`~cbteach.core.modelinfo.ModelInfo`) with the layer count, KV heads and head size the
    layers really use; ``ValueError`` naming why the paged cache cannot run ``model`` exactly."""
    name = type(model).__name__
    calls = record_calls(model)
    if not calls:
        raise ValueError(f"{name}'s attention layers do not pass the forward's keyword arguments on to their "
                         "attention function, so the paged cache's step metadata would never reach it: use kv='concat'")
    first = calls[0]
    layers = [c.layer for c in calls]
    if None in layers:
        raise ValueError(f"{first.module} has no layer_idx, which the paged pool is indexed by: use kv='concat'")
    twice = sorted({i for i in layers if layers.count(i) > 1})
    if twice:
        raise ValueError(f"{first.module} calls its attention function {layers.count(twice[0])} times in one layer "
                         "(differential attention, as in DiffLlama?); the paged pool keeps one K/V per layer and "
                         "token, so a second call would overwrite the first one's: use kv='concat'")
    masked = next((c for c in calls if c.has_mask), None)
    if masked is not None:
        raise ValueError(f"{masked.module} hands its attention function a mask of its own (a learned or dynamic "
                         "mask, as in Doge); the paged attention builds its causal mask from the block tables and "
                         "would drop it: use kv='concat'")
    extra = next((c for c in calls if c.extra_terms), None)
    if extra is not None:  # (Gemma-2's logit soft-capping, GPT-OSS's attention sinks)
        raise ValueError(f"{extra.module} hands its attention function {extra.extra_terms}, which the engine's paged "
                         "attention does not apply: use kv='concat'")
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"{first.module}'s layer_idx values are {sorted(layers)}, not 0..{len(layers) - 1}: the paged "
                         "pool holds one K/V tensor per layer, by that index: use kv='concat'")
    shapes = {(c.key_shape[1], c.key_shape[-1], c.value_shape[1], c.value_shape[-1]) for c in calls}
    if len(shapes) > 1:
        raise ValueError(f"{name}'s layers hand over keys and values of different shapes ({sorted(shapes)}); the paged "
                         "pool keeps one shape for every layer: use kv='concat'")
    kv_heads, head_dim, v_heads, v_head_dim = shapes.pop()
    if (v_heads, v_head_dim) != (kv_heads, head_dim):
        raise ValueError(f"this model's value heads ({v_head_dim}) are not as wide as its key heads ({head_dim}) -- "
                         "latent attention, as in DeepSeek-V2/V3 -- and the paged pool keeps one head size for both: "
                         "use kv='concat'" if v_head_dim != head_dim else
                         f"this model has {v_heads} value heads and {kv_heads} key heads; the paged pool keeps as many "
                         "of both: use kv='concat'")
    return dataclasses.replace(info, num_layers=len(layers), num_kv_heads=kv_heads, head_dim=head_dim)


def check_concat_runs(model, info) -> None:
    """The concat cache hands the model its own attention with a 4-D mask over a packed row and a cache: one packed
    prefill of two short sequences, through a view of the model and a cache of its own, shows now whether the
    model takes those inputs (XLM asserts on the mask's shape; some sdpa paths mis-shape a mask with grouped
    heads) -- rather than as an error in every request. ``ValueError`` with the model's own error."""
    from ..core.model_view import model_view
    from ..core.modelinfo import check_takes_cache
    from .concat import ConcatKVCache

    check_takes_cache(info, "kv='concat'")
    kv = ConcatKVCache(info.num_layers, cache_kwarg=info.cache_kwarg, attn_implementation=info.attn_implementation,
                       dtype=info.dtype)
    meta = kv.build_metadata([1, 1, 1], [0, 0], [2, 1], info.device, request_ids=["a", "b"])  # (ids < any vocab)
    try:
        with torch.inference_mode():
            model_view(model, share_hooks=False)(input_ids=meta.input_ids, position_ids=meta.positions,
                                                **kv.forward_kwargs(meta))
    except Exception as err:  # noqa: BLE001  (the model's own error, whatever it is, is the reason)
        raise ValueError(f"{type(model).__name__} fails on the concat cache's inputs (its own attention, a 4-D mask "
                         f"over a packed row, a cache): {type(err).__name__}: {str(err)[:200] or '(no message)'}; use "
                         "kv='paged', or a model that takes them (Llama, Qwen2, GPT-2, bierce)") from None
