"""What the engine assumed about the model when it was built -- checked before it runs again.

An engine reads a model once: its dtype and device (the KV pool is made to match), its modules (the
engine's own view of the model copies the module tree, :mod:`cbteach.core.model_view`), its EOS ids
(the stop rule), and it computes with the weights as they are. If any of that changes under it --
``model.to(torch.float16)``, ``resize_token_embeddings``, an adapter swapped in, a new EOS id, an
optimizer step -- an engine that went on would be silently wrong: a float32 pool for float16 keys,
a view still calling the old embedding, the old stop rule, or (for weights updated in place) a
request whose first tokens came from other weights than its last.

So :func:`fingerprint` takes a cheap snapshot (identities and version counters, no tensor is read),
and the engine compares it at every ``run()``, ``stream()`` and ``step()``. The rule: **an engine
belongs to the model as it was when the engine was built; change the model, build a new engine.**
(vLLM has no such check because its engine loads the weights itself and nobody else holds them.)
"""
from __future__ import annotations

from ..core.modelinfo import eos_ids_for


def fingerprint(model, tokenizer=None) -> tuple:
    """A snapshot of what the engine depends on. ``Tensor._version`` is torch's counter of in-place
    changes (autograd uses it to notice a saved tensor was modified): any in-place weight update bumps it."""
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
