"""An engine belongs to the model as it was when the engine was built: change the model, build a new engine.

The engine reads a model's dtype, device, modules, EOS ids and weights once; after ``model.to(...)``, a
resized embedding, an adapter or an optimizer step it would be silently wrong. :func:`fingerprint`
snapshots identities and version counters (no tensor is read). The engine core compares a cheap part
of it every step (:meth:`~cbteach.engine.engine_core.EngineCore.check_model`) and the whole, here, only
when that differs. (vLLM needs no such check: its engine loads the weights itself.)
"""
from __future__ import annotations

from ..core.modelinfo import eos_ids_for


def fingerprint(model, tokenizer=None) -> tuple:
    """A snapshot of what the engine depends on (``Tensor._version``: torch's count of in-place changes)."""
    params = list(model.parameters())
    first = params[0] if params else None
    return (
        (first.dtype, first.device) if first is not None else None,
        tuple(id(m) for m in model.modules()),  # a module replaced anywhere (embeddings, an adapter)
        tuple(id(p) for p in params),
        sum(p._version for p in params),
        eos_ids_for(model, tokenizer),
    )


WHAT = ("the model's dtype or device", "a module of the model (replaced: resize_token_embeddings, an adapter?)",
        "a parameter of the model (replaced)", "the weights (updated in place)", "the EOS ids")


def check_unchanged(before: tuple, model, tokenizer=None) -> None:
    """Raise :class:`~cbteach.errors.ModelChangedError` naming what changed since ``before``."""
    from ..errors import ModelChangedError
    now = fingerprint(model, tokenizer)
    if now != before:
        changed = [w for w, a, b in zip(WHAT, before, now) if a != b]
        raise ModelChangedError(f"{' and '.join(changed)} changed after this engine was built; an engine belongs to "
                                "the model as it was then -- build a new Engine for the model as it is now")
