"""An engine belongs to the model as it was when the engine was built: change the model, build a new engine.

The engine reads a model's dtype, device, modules, EOS ids and weights once; after ``model.to(...)``, a
resized embedding, an adapter or an optimizer step it would be silently wrong. :func:`fingerprint`
snapshots identities, storage addresses and version counters (no tensor is read). The engine core compares
a cheap part of it every step (:meth:`~cbteach.engine.engine_core.EngineCore.check_model`) and the whole,
here, only when that differs. (vLLM needs no such check: its engine loads the weights itself.)

What it cannot see: a write *into* a weight through ``.data`` (``p.data.copy_(...)``), which bypasses
torch's version counter on purpose -- autograd does not see it either. Setting ``p.data = ...``
(``vector_to_parameters``, ``module.to(dtype)`` on part of the model) moves the storage, and is seen.
"""
from __future__ import annotations

from ..core.modelinfo import eos_ids_for


def fingerprint(model, tokenizer=None) -> tuple:
    """A snapshot of what the engine depends on."""
    params = list(model.parameters())
    return (
        tuple(sorted({(str(p.dtype), str(p.device)) for p in params})),
        tuple(id(m) for m in model.modules()),  # a module replaced anywhere (embeddings, an adapter)
        tuple(id(p) for p in params),
        tuple((p.data_ptr(), p._version) for p in params),  # where each weight lives; its in-place changes (torch's count)
        eos_ids_for(model, tokenizer),
    )


WHAT = ("the model's dtype or device (of some weights, or all)",
        "a module of the model (replaced: resize_token_embeddings, an adapter?)",
        "a parameter of the model (replaced)", "the weights (updated in place, or set through .data)", "the EOS ids")


def check_unchanged(before: tuple, model, tokenizer=None) -> None:
    """Raise :class:`~cbteach.errors.ModelChangedError` naming what changed since ``before``."""
    from ..errors import ModelChangedError
    now = fingerprint(model, tokenizer)
    if now != before:
        changed = [w for w, a, b in zip(WHAT, before, now) if a != b]
        raise ModelChangedError(f"{' and '.join(changed)} changed after this engine was built; an engine belongs to "
                                "the model as it was then -- build a new Engine for the model as it is now")
