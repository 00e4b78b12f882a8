"""The engine's own errors: a rule of the engine was broken, so it stops instead of giving wrong tokens.

A plugged-in piece -- a scheduler of your own (``scheduler_cls``), a KV manager (``kv_manager``), a
slot mapping or an attention function (notebooks 05, 06 and 12) -- can break a rule that every
request relies on: a plan over the token budget, a token scheduled without room from
``allocate_slots``, a block that is never given back, K/V written to the wrong slot. Then no
request's tokens can be trusted, so the engine raises :class:`EngineRuleError`, naming the rule,
rather than ending one request (``finish_reason="error"`` is for failures that belong to one
request alone: its sampling, the model on its tokens).
"""
from __future__ import annotations


class EngineRuleError(RuntimeError):
    """A plugged-in piece broke a rule of the engine; the message names the rule."""


class EngineDeadError(RuntimeError):
    """A part of the engine outside this process died (a tensor-parallel worker): the engine cannot go on."""


class ModelChangedError(RuntimeError):
    """The model changed under the engine (dtype, device, modules, EOS ids or weights): build a new engine."""


class EngineClosedError(RuntimeError):
    """The engine was closed (:meth:`cbteach.Engine.close`): build a new one."""
