"""What the engine needs to know about a transformers model, read once through public attributes."""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import torch

from .model_view import cache_kwarg_of


def max_positions(config) -> int | None:
    """How many positions the model supports (``max_position_embeddings`` or GPT-2's ``n_positions``)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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
    cache_kwarg: str | None  # "cache" in transformers >= 5.x, "past_key_values" before; None: it takes no cache
    accepts_logits_to_keep: bool
    attn_implementation: str = "sdpa"
    v_head_dim: int | None = None  # set where a value head differs from a key head (DeepSeek's latent attention)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def eos_ids_for(model, tokenizer=None) -> frozenset:
    """The ids a request stops on: exactly those ``generate`` stops on -- the model's
    ``generation_config.eos_token_id`` (``config.eos_token_id`` only for a model without a
    generation config: ``generate`` reads nothing else, so a config's EOS that the generation
    config sets to None stops nothing). The tokenizer's EOS is deliberately *not* added: where it
    differs, ``generate`` would keep going, and so must we. ``tokenizer`` is accepted for symmetry
    and ignored."""
    ids: set = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else getattr(model.config, "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(int(i) for i in ids)


# RoPE variants whose frequencies depend on the longest sequence in the forward pass. In a packed
# row that length is the *whole row's*, so a long neighbour would change a short request's logits.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_supported(config, max_pos) -> None:
    """Refuse, with the reason, models whose attention the engine's masks cannot reproduce exactly."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if isinstance(getattr(config, "attention_layers", None), (list, tuple)):  # GPT-Neo's names: "global", "local"
        local = getattr(config, "window_size", None)
        layer_types += ["full_attention" if t == "global" else t for t in config.attention_layers
                        if t == "global" or not (max_pos is not None and isinstance(local, int) and local >= max_pos)]
    windowed = [t for t in layer_types if t != "full_attention"]
    other = sorted({t for t in windowed if "sliding" not in t and "chunk" not in t and "local" not in t})
    if other:  # mamba, linear attention: a state carried along the row, which packed sequences would share
        raise ValueError(f"this model has layers that are not attention over a KV cache (layer types {other}); "
                         "cbteach's engine runs models whose every layer is full attention (Llama, Qwen2, GPT-2, bierce)")
    uses_window = bool(windowed) or (
        getattr(config, "use_sliding_window", True) is not False and isinstance(window, int) and window > 0
        and (max_pos is None or window < max_pos))  # a window as long as the model never bites
    if uses_window:
        kind = f"layer types {sorted(set(windowed))}" if windowed else f"sliding_window={window}"
        raise ValueError(f"this model uses sliding-window or local attention ({kind}); cbteach's masks are full "
                         "causal, so its output would differ from generate's once a sequence outgrows the window. "
                         "Use a full-attention model (Llama, Qwen2 with use_sliding_window=False, GPT-2, bierce)")
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(f"this model uses chunked attention (attention_chunk_size="
                         f"{config.attention_chunk_size}); cbteach's masks are full causal. Use a full-attention model")
    no_rope = getattr(config, "no_rope_layers", None) or []
    if getattr(config, "attn_temperature_tuning", False) and not all(no_rope):
        raise ValueError("this model's layers without RoPE scale their queries by position (attn_temperature_tuning), "
                         "counted from the cache's length rather than from position_ids; in a packed row that is not "
                         "each token's own position. Use a model without it (Llama, Qwen2, GPT-2, bierce)")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_types = {r.get("rope_type", r.get("type")) for r in (rope.values() if all(isinstance(v, dict) for v in
                  rope.values()) and rope else [rope]) if isinstance(r, dict)}
    bad = sorted(t for t in rope_types if t in LENGTH_DEPENDENT_ROPE)
    if bad:
        raise ValueError(f"this model's RoPE ({bad[0]!r}) picks its frequencies from the longest sequence in the "
                         "forward pass; in a packed batch that is the whole row, so neighbours would change each "
                         "other's output. Use a model with position-independent RoPE (default, linear, llama3, yarn)")


# Settings that make ``generate``'s greedy search differ from a plain argmax; the engine has none.
_IGNORED_GENERATION = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None,
                       "min_length": 0, "suppress_tokens": None, "begin_suppress_tokens": None,
                       "bad_words_ids": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                       "encoder_repetition_penalty": 1.0, "sequence_bias": None,
                       "exponential_decay_length_penalty": None, "num_beams": 1, "num_beam_groups": 1,
                       "penalty_alpha": None, "guidance_scale": None, "watermarking_config": None}


def ignored_generation_settings(model) -> dict:
    """Settings in the model's ``generation_config`` that the engine's plain argmax does not apply."""
    gen = getattr(model, "generation_config", None)
    return {k: getattr(gen, k) for k, neutral in _IGNORED_GENERATION.items()
            if gen is not None and getattr(gen, k, neutral) not in (neutral, None, [], 0)}


def check_weights(model, what: str = "") -> None:
    """``ValueError`` unless ``model``'s weights are loaded (not on the 'meta' device) and on one device."""
    name = what or type(model).__name__
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(f"{name}'s weights are on the 'meta' device: they were never loaded (a model built under "
                         "init_empty_weights, or with device_map offloading); load them first (from_pretrained, or "
                         "to_empty and load_state_dict)")
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"{name}'s weights are on several devices ({', '.join(sorted(map(str, devices)))}); the "
                         "engine runs a model on one device: move it there (model.to(device))")


def check_takes_cache(info: ModelInfo, what: str) -> None:
    """``what`` (a batcher that keeps each sequence's K/V in the model's own cache between steps) needs a forward
    that takes a cache: ``ValueError`` where it takes none (the cache would be ignored, and tokens wrong)."""
    if info.cache_kwarg is None:
        raise ValueError(f"this model's forward takes no KV cache (no 'cache' or 'past_key_values' argument), so "
                         f"{what}, which hands each step the sequences' cached keys and values, cannot run it: use "
                         "a model with a cache (Llama, Qwen2, GPT-2, bierce)")


def describe(model, tokenizer=None) -> ModelInfo:
    """What the engine needs to know of ``model`` (a transformers causal LM), read once."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config") \
            or not hasattr(model, "get_input_embeddings"):
        raise ValueError(f"model must be a transformers causal LM (cbteach.load_model() gives one), "
                         f"got {type(model).__name__}")
    head = getattr(model, "get_output_embeddings", None)
    if callable(head) and head() is None:  # (AutoModel's LlamaModel, GPT2Model: hidden states, no logits)
        raise ValueError(f"{type(model).__name__} is a base model without a language-model head: it gives hidden "
                         "states, not logits over the vocabulary. Load the causal LM "
                         "(AutoModelForCausalLM.from_pretrained, or cbteach.load_model)")
    check_weights(model)
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):  # (every completion decodes)
        raise ValueError(f"tokenizer must be None or a transformers tokenizer (with decode(ids)), "
                         f"got {type(tokenizer).__name__} {(repr(tokenizer).splitlines() or [''])[0][:80]}")
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    check_supported(text_config, max_positions(text_config))
    bidirectional = next((m for m in model.modules() if getattr(m, "is_causal", None) is False
                          and hasattr(m, "layer_idx") and not getattr(m, "is_cross_attention", False)), None)
    if bidirectional is not None or getattr(text_config, "causal", True) is False:  # (BERT as an encoder; XLM)
        raise ValueError(f"{type(model).__name__} attends both ways ("
                         f"{type(bidirectional).__name__ + '.is_causal is False' if bidirectional is not None else 'causal=False'}"
                         "): each token sees the ones after it, so it is no causal LM and generate's tokens depend on "
                         "the whole prompt at once. Use a causal model (for BERT-style heads, is_decoder=True)")
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params or getattr(text_config, "alibi", False):
        raise ValueError(f"{type(model).__name__} does not take each token's position from position_ids (it reads "
                         "positions from where tokens sit in its input: ALiBi in Bloom, MPT or Falcon with alibi=True; "
                         "a recurrent state in Mamba or RWKV); the engine packs many sequences into one row and gives "
                         "each token its position in position_ids, so packed sequences would see wrong positions. "
                         "Use a model that reads position_ids (Llama, Qwen2, GPT-2, bierce)")
    num_heads = getattr(text_config, "num_attention_heads", None) or getattr(text_config, "n_head", None)
    if not num_heads:
        raise ValueError(f"{type(model).__name__}'s config names no attention heads (num_attention_heads): cbteach's "
                         "engine runs attention models (Llama, Qwen2, GPT-2, bierce)")
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    hidden = getattr(text_config, "hidden_size", None) or text_config.n_embd
    head_dim = getattr(text_config, "head_dim", None) or hidden // num_heads
    v_head_dim = getattr(text_config, "v_head_dim", None)
    if v_head_dim and getattr(text_config, "qk_nope_head_dim", None) is not None:  # latent attention: K is nope + rope
        head_dim = text_config.qk_nope_head_dim + (getattr(text_config, "qk_rope_head_dim", None) or 0)
    num_layers = getattr(text_config, "num_hidden_layers", None) or text_config.n_layer
    ignored = ignored_generation_settings(model)
    if ignored:
        warnings.warn(f"the model's generation_config sets {ignored}; cbteach decodes with a plain argmax, so "
                      "its output will differ from model.generate", stacklevel=3)
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
        cache_kwarg=cache_kwarg_of(model),
        accepts_logits_to_keep="logits_to_keep" in params,
        attn_implementation=getattr(config, "_attn_implementation", None) or "eager",
        v_head_dim=v_head_dim if v_head_dim and v_head_dim != head_dim else None,
    )
