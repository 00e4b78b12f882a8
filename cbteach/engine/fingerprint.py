"""An engine belongs to the model as it was when the engine was built: change the model, build a new engine.

The engine reads a model's dtype, device, modules, EOS ids and weights once; after ``model.to(...)``, a
resized embedding, an adapter or an optimizer step it would be silently wrong. :func:`fingerprint`
snapshots identities and version counters (no tensor is read); :class:`ModelWatch` compares a cheap
part of it every step (torch's registration hooks count modules and parameters set on the model) and
the whole only when that differs. (vLLM needs no such check: its engine loads the weights itself.)
"""
from __future__ import annotations

import weakref

from torch.nn.modules import module as torch_module

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


_registrations = [0]  # modules and parameters set on a watched model's modules, since the first watch
_watched: weakref.WeakSet = weakref.WeakSet()  # every module of every watched model (gone with the model)


def _count_registration(module, *_args) -> None:
    """torch's registration hook: count what is set on a watched model's module (returns None: no change)."""
    if module in _watched:
        _registrations[0] += 1


def _hook_registrations() -> None:
    if not _registrations[0]:
        _registrations[0] = 1  # (hooked once per process)
        torch_module.register_module_module_registration_hook(_count_registration)
        torch_module.register_module_parameter_registration_hook(_count_registration)


class ModelWatch:
    """A cheap comparison every step; the full :func:`fingerprint` when it differs."""

    def __init__(self, model, tokenizer=None):
        _hook_registrations()
        _watched.update(model.modules())
        self.model, self.tokenizer = model, tokenizer
        self.before = fingerprint(model, tokenizer)
        self._snapshot()

    def _snapshot(self) -> None:
        self.params = list(self.model.parameters())
        self.quick = self._quick()

    def _quick(self) -> tuple:
        first = self.params[0] if self.params else None
        gen = getattr(self.model, "generation_config", None)
        return (_registrations[0], (first.dtype, first.device) if first is not None else None,
                sum(p._version for p in self.params), repr(getattr(gen, "eos_token_id", None)),
                repr(getattr(self.model.config, "eos_token_id", None)))

    def check(self) -> None:
        """Raise :class:`~cbteach.errors.ModelChangedError` if the model changed since the engine was built."""
        if self._quick() == self.quick:
            return
        check_unchanged(self.before, self.model, self.tokenizer)
        self._snapshot()  # nothing the engine depends on changed (a module set again, say)
