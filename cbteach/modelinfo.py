"""What the engine needs to know about a transformers model, read once through public attributes."""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import torch

from .request import max_positions


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_positions: int | None
    eos_ids: frozenset
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    cache_kwarg: str  # "cache" in transformers >= 5.x, "past_key_values" before
    accepts_logits_to_keep: bool

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def eos_ids_for(model, tokenizer=None) -> frozenset:
    """EOS ids: those of the model's ``generation_config`` (what ``generate`` stops on), plus the
    tokenizer's EOS when a tokenizer is given (chat models often list several, e.g. end-of-turn)."""
    ids: set = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tok_eos is not None:
        ids.add(tok_eos)
    return frozenset(ids)


# Settings that make ``generate``'s greedy search differ from a plain argmax; the engine has none.
_IGNORED_GENERATION = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None,
                       "min_length": 0, "suppress_tokens": None, "begin_suppress_tokens": None,
                       "bad_words_ids": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                       "encoder_repetition_penalty": 1.0, "sequence_bias": None}


def ignored_generation_settings(model) -> dict:
    """Settings in the model's ``generation_config`` that the engine's plain argmax does not apply."""
    gen = getattr(model, "generation_config", None)
    return {k: getattr(gen, k) for k, neutral in _IGNORED_GENERATION.items()
            if gen is not None and getattr(gen, k, neutral) not in (neutral, None, [], 0)}


def describe(model, tokenizer=None) -> ModelInfo:
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None) or []
    if getattr(text_config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError("models with sliding-window attention are not supported: the engine's masks "
                         "are full causal; set use_sliding_window=False in the config")
    num_heads = getattr(text_config, "num_attention_heads", None) or text_config.n_head
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    hidden = getattr(text_config, "hidden_size", None) or text_config.n_embd
    head_dim = getattr(text_config, "head_dim", None) or hidden // num_heads
    num_layers = getattr(text_config, "num_hidden_layers", None) or text_config.n_layer
    ignored = ignored_generation_settings(model)
    if ignored:
        warnings.warn(f"the model's generation_config sets {ignored}; cbteach decodes with a plain argmax, so "
                      "its output will differ from model.generate", stacklevel=3)
    params = inspect.signature(model.forward).parameters
    param = next(model.parameters())
    return ModelInfo(
        vocab_size=model.get_input_embeddings().num_embeddings,
        max_positions=max_positions(text_config),
        eos_ids=eos_ids_for(model, tokenizer),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=param.dtype,
        device=param.device,
        cache_kwarg="cache" if "cache" in params else "past_key_values",
        accepts_logits_to_keep="logits_to_keep" in params,
    )
