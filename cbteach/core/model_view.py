"""A per-engine view of a model: the same weights, its own modules and config.

The engine needs two things from a model that its owner does not: **eval mode** (dropout off, so
outputs are deterministic) and, for the paged cache, **its own attention function** (transformers
picks a layer's attention by ``config._attn_implementation``). Flipping those on the user's model
-- even for the length of one step -- changes state that everybody else reads: another thread
running ``model.generate`` with a padded batch, or a second engine on the same model, would run
with the wrong attention or without its mask.

So the engine never touches the model. :func:`model_view` builds a *view*: a new object of each
module's class whose ``__dict__`` is a copy of the original's (so its own ``training`` flag and
child modules), sharing the original's parameter and buffer dicts (no tensor is copied: the weights
are the same memory), with every reference to the model's config replaced by a private copy. The
view's config carries the engine's attention implementation; the model's config never changes.
Forward hooks registered on the model are shared with the view, so a hook sees the engine's calls.
"""
from __future__ import annotations

import copy
import inspect

import torch


def cache_kwarg_of(model) -> str | None:
    """The name of the KV cache argument of ``model``'s forward: ``"cache"`` (transformers 5),
    ``"past_key_values"`` (before), or ``None`` where it takes none."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values" if "past_key_values" in params else None


def model_view(model: torch.nn.Module, attn_implementation: str | None = None, share_hooks: bool = True) -> torch.nn.Module:
    """A view of ``model`` in eval mode; with ``attn_implementation``, its layers call that attention
    function (registered with transformers' ``AttentionInterface``) while ``model`` keeps its own.
    A model whose layers never look the function up (transformers' ``is_backend_compatible()`` is False:
    Falcon, StableLM, remote code) is refused: its own attention would run over the packed row instead,
    across sequences and without their cached K/V, and give wrong tokens. ``share_hooks=False``: the model's
    forward hooks do not fire on the view (a look at the model's attention that is not one of the engine's steps)."""
    compatible = getattr(type(model), "is_backend_compatible", None)
    if attn_implementation is not None and callable(compatible) and not compatible():
        concat = ("kv='concat' (the model's own attention, with the engine's mask), or "
                  if cache_kwarg_of(model) is not None else "")  # (none without a cache argument)
        raise ValueError(f"{type(model).__name__}'s attention layers do not call the attention functions "
                         "registered with transformers' AttentionInterface (its is_backend_compatible() is False), "
                         f"so the paged KV cache cannot plug in: use {concat}a model whose attention does (Llama, "
                         "Qwen2, GPT-2, bierce)")
    config = getattr(model, "config", None)
    configs: dict[int, object] = {}
    if config is not None:
        view_config = copy.deepcopy(config)
        _map_configs(config, view_config, configs)
        if attn_implementation is not None:
            view_config._attn_implementation = attn_implementation  # the copy's setter reaches its sub-configs
    view = _shell(model, configs, {}, share_hooks)
    view.eval()  # the view's own training flags: the model's stay as they are
    return view


def _map_configs(original, copied, out: dict) -> None:
    """Pair each config (and sub-config, at any depth) of the model with its copy, by identity."""
    out[id(original)] = copied
    for key in getattr(original, "sub_configs", {}) or {}:
        sub = getattr(original, key, None)
        if sub is not None:
            _map_configs(sub, getattr(copied, key), out)


def _shell(module: torch.nn.Module, configs: dict, memo: dict, share_hooks: bool = True) -> torch.nn.Module:
    """A new object of ``module``'s class with a copy of its attributes and views of its children (with
    ``share_hooks=False``, empty forward-hook dicts of its own)."""
    if id(module) in memo:  # a module used twice stays one module in the view
        return memo[id(module)]
    view = object.__new__(type(module))
    memo[id(module)] = view
    attrs = dict(module.__dict__)  # parameters and buffers: the same dicts, so the same tensors
    if attrs.get("_compiled_call_impl") is not None:  # model.compile(): a compiled call of the *model* (its training
        attrs["_compiled_call_impl"] = None           # flag, its config); the view runs its own forward, eagerly
    for name, value in attrs.items():
        if id(value) in configs:
            attrs[name] = configs[id(value)]
        elif not share_hooks and name.startswith("_forward") and isinstance(value, dict):
            attrs[name] = type(value)()  # torch's _forward_hooks, _forward_pre_hooks, ... (empty: the same kind)
    view.__dict__.update(attrs)
    # torch keeps child modules in a dict: the view needs its own, or adding a child would add it to both.
    object.__setattr__(view, "_modules", {})
    for name, child in module.named_children():
        view.add_module(name, _shell(child, configs, memo, share_hooks))
    return view
