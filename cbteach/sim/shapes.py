"""Model shapes as data: what a cost model needs to know of a transformer, and nothing else (no weights).

A step's cost depends on a handful of numbers from the model's transformers config -- layers,
hidden size, attention heads and KV heads, head size, MLP width, vocabulary -- from which follow
the parameter count (weights to read every step), the K/V bytes per token (what the cache holds
and attention reads) and the FLOPs per token. :func:`shape_from_config` reads them from any
transformers config (an object or its ``config.json`` as a dict) with the attribute names
:func:`cbteach.core.modelinfo.describe` reads; :data:`MODELS` ships the configs of a few common
models, copied from their ``config.json`` on the Hugging Face hub, so the simulator needs no
download.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The numbers of one decoder-only transformer that decide what a step costs."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU (Llama, Qwen2): three matrices; OPT/GPT-2: two
    tied_embeddings: bool = False
    max_positions: int = 4096
    source: str = ""

    @property
    def layer_params(self) -> int:
        """Weights of one layer: the attention projections and the MLP (norms and biases are tiny)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q and o; k and v
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return attn + mlp

    @property
    def embedding_params(self) -> int:
        """The embedding and the LM head (one matrix when they are tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def __str__(self) -> str:
        n = self.num_params
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        return (f"{self.name}: {size} parameters, {self.num_layers} layers, "
                f"{self.num_heads} heads / {self.num_kv_heads} KV heads of {self.head_dim}")


def _get(config, *names, default=None):
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def shape_from_config(config, name: str | None = None, source: str = "") -> ModelShape:
    """A :class:`ModelShape` from a transformers config object or its ``config.json`` dict."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    model_type = _get(config, "model_type", default="")
    heads = _get(config, "num_attention_heads", "n_head")
    hidden = _get(config, "hidden_size", "n_embd", "d_model")
    if not heads or not hidden:
        raise ValueError("a model shape needs the config's num_attention_heads and hidden_size (or GPT-2's n_head, "
                         "n_embd)")
    inter = _get(config, "intermediate_size", "ffn_dim", "n_inner") or 4 * hidden
    gated = model_type not in ("gpt2", "opt", "gpt_neox", "bloom", "falcon")
    return ModelShape(
        name=name or _get(config, "_name_or_path", default="") or model_type or "model",
        num_layers=_get(config, "num_hidden_layers", "n_layer"), hidden_size=hidden, num_heads=heads,
        num_kv_heads=_get(config, "num_key_value_heads", default=heads),
        head_dim=_get(config, "head_dim", default=hidden // heads), intermediate_size=inter,
        vocab_size=_get(config, "vocab_size"), gated_mlp=gated,
        tied_embeddings=bool(_get(config, "tie_word_embeddings", default=model_type in ("gpt2", "opt"))),
        max_positions=_get(config, "max_position_embeddings", "n_positions", default=4096), source=source)


# The fields a cost model reads, copied from each model's config.json on the Hugging Face hub.
_HUB = "https://huggingface.co/{}/blob/main/config.json"
_CONFIGS = {
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", dict(
        model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", dict(
        model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", dict(
        model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)),
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", dict(
        model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", dict(
        model_type="qwen2", num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072, tie_word_embeddings=False)),
    "opt-13b": ("facebook/opt-13b", dict(
        model_type="opt", num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, ffn_dim=20480,
        vocab_size=50272, max_position_embeddings=2048, tie_word_embeddings=True)),
}


def _bierce() -> ModelShape:
    path = Path(__file__).resolve().parent.parent / "bierce" / "config.json"
    return shape_from_config(json.loads(path.read_text()), name="bierce", source="cbteach/bierce/config.json")


MODELS: dict[str, ModelShape] = {key: shape_from_config(cfg, name=key, source=_HUB.format(repo))
                                 for key, (repo, cfg) in _CONFIGS.items()}
MODELS["bierce"] = _bierce()


def get_model(name) -> ModelShape:
    """A shipped shape by name (:data:`MODELS`), or a :class:`ModelShape`/config passed through."""
    if isinstance(name, ModelShape):
        return name
    if not isinstance(name, str):
        return shape_from_config(name)
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; shipped shapes: {', '.join(MODELS)} (or pass a transformers config)")
    return MODELS[key]
