"""Megatron-style sharding of a transformers model's own modules: who holds which heads, and which rows.

Tensor parallelism (Shoeybi et al., *Megatron-LM*, 2019) splits every transformer layer across ``N``
ranks so that each holds ``1/N`` of the weights and does ``1/N`` of the work, with **one all-reduce
after attention and one after the MLP** -- nothing else moves between ranks:

* **column-parallel** (split by output rows): the query/key/value projections -- rank ``r`` keeps the
  rows that make *its* attention heads -- and the MLP's gate/up projections (a slice of the
  intermediate features). Its input is the full hidden state every rank has; its output is local;
* attention itself needs nothing from other ranks: a head attends with its own query, key and value;
* **row-parallel** (split by input columns): the attention output projection and the MLP's down
  projection. Each rank multiplies its slice of the features by its slice of the weight and gets a
  *partial sum* of the full output; an all-reduce (sum) gives every rank the same full output. A
  bias is added once (rank 0 keeps it, the others hold none).

Embeddings, norms and the LM head are **replicated** (every rank holds them whole and computes the
same numbers; vocabulary-parallel embeddings would save memory at the price of two more collectives
per step -- not done here). Each rank's paged KV pool holds only its KV heads.

**Grouped-query attention with fewer KV heads than ranks** (Llama-3-70B: 8 KV heads; ``N = 16``):
a KV head cannot be split, so it is **replicated** on ``N / num_kv_heads`` ranks (vLLM's rule), each
keeping the query heads that read it. That needs ``N`` to be a multiple of ``num_kv_heads``;
otherwise the configuration is refused. With ``num_kv_heads >= N`` it must divide by ``N``.

The model is not rewritten: each rank builds the same transformers class from the same config and
gets smaller weight tensors in the same modules (plus GPT-2's ``split_size`` and ``Conv1D.nf``,
the sizes its forward reads); a forward hook on each row-parallel module does the all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ARCHITECTURES = ("llama", "qwen2", "gpt2")  # model_type values whose module names are known here


@dataclass(frozen=True)
class Layout:
    """How ``world_size`` ranks split one model: heads, KV heads and intermediate features."""

    arch: str
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    num_layers: int

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world_size

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold a copy of each KV head (1 unless there are fewer KV heads than ranks)."""
        return max(1, self.world_size // self.num_kv_heads)

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    def q_heads(self, rank: int) -> range:
        """The query heads rank ``rank`` computes."""
        return range(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)

    def kv_heads(self, rank: int) -> range:
        """The KV heads rank ``rank`` holds (a replicated one is held by several ranks)."""
        first = rank // self.kv_replicas * self.kv_heads_per_rank
        return range(first, first + self.kv_heads_per_rank)

    def features(self, rank: int) -> range:
        """The MLP's intermediate features rank ``rank`` computes."""
        n = self.intermediate_size // self.world_size
        return range(rank * n, (rank + 1) * n)

    def describe(self) -> list[str]:
        """One line per rank: who holds which heads (for notebook 13)."""
        return [f"rank {r}: query heads {_span(self.q_heads(r))}, KV heads {_span(self.kv_heads(r))}, "
                f"MLP features {_span(self.features(r))}" for r in range(self.world_size)]


def _span(r: range) -> str:
    return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def layout_for(model, world_size: int) -> Layout:
    """The split of ``model`` over ``world_size`` ranks, or ``ValueError`` saying why it cannot be split."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world_size!r}")
    config = model.config
    arch = getattr(config, "model_type", None)
    if arch not in ARCHITECTURES:
        raise ValueError(f"tensor parallelism shards {', '.join(ARCHITECTURES)} models (their module names are "
                         f"known); got model_type {arch!r}")
    if arch == "gpt2":
        heads, hidden = config.n_head, config.n_embd
        kv, inter = heads, getattr(config, "n_inner", None) or 4 * hidden
        head_dim = hidden // heads
    else:
        heads, hidden, inter = config.num_attention_heads, config.hidden_size, config.intermediate_size
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
    n = world_size
    if n > heads:
        raise ValueError(f"tensor_parallel_size={n} is more ranks than the model's {heads} attention heads: "
                         "every rank needs at least one head")
    if heads % n:
        raise ValueError(f"the model's {heads} attention heads do not divide among {n} ranks; use a "
                         f"tensor_parallel_size that divides {heads}")
    if kv >= n and kv % n:
        raise ValueError(f"the model's {kv} KV heads do not divide among {n} ranks; use a tensor_parallel_size "
                         f"that divides {kv}")
    if kv < n and n % kv:
        raise ValueError(f"the model has {kv} KV heads, fewer than {n} ranks: each KV head is then replicated on "
                         f"tensor_parallel_size / num_kv_heads ranks, so {n} must be a multiple of {kv}")
    if inter % n:
        raise ValueError(f"the MLP's {inter} intermediate features do not divide among {n} ranks")
    return Layout(arch=arch, world_size=n, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, hidden_size=hidden,
                  intermediate_size=inter, num_layers=len(_blocks(model)))


# -- which module is split how ----------------------------------------------------------------------
def _blocks(model) -> list:
    base = getattr(model, "transformer", None) if model.config.model_type == "gpt2" else getattr(model, "model", None)
    return list(base.h if model.config.model_type == "gpt2" else base.layers)


def _prefix(model) -> str:
    return "transformer.h" if model.config.model_type == "gpt2" else "model.layers"


def _rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def split_rules(layout: Layout, rank: int) -> dict[str, tuple]:
    """For each sharded parameter suffix inside a layer: ``(dim, index)`` -- keep ``index`` along ``dim``
    -- or ``("bias_once",)`` for a row-parallel bias (rank 0 keeps it). nn.Linear weights are
    ``[out, in]``; GPT-2's Conv1D weights are ``[in, out]``."""
    q, kv, d = layout.q_heads(rank), layout.kv_heads(rank), layout.head_dim
    f = layout.features(rank)
    feat = slice(f.start, f.stop)
    if layout.arch == "gpt2":
        e = layout.hidden_size
        qkv = torch.cat([torch.arange(e * i + q.start * d, e * i + q.stop * d) for i in range(3)])  # q, k, v parts
        return {"attn.c_attn.weight": (1, qkv), "attn.c_attn.bias": (0, qkv),
                "attn.c_proj.weight": (0, _rows(q, d)), "attn.c_proj.bias": ("bias_once",),
                "mlp.c_fc.weight": (1, feat), "mlp.c_fc.bias": (0, feat),
                "mlp.c_proj.weight": (0, feat), "mlp.c_proj.bias": ("bias_once",)}
    rules = {}
    for name, heads in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        rules[f"self_attn.{name}.weight"] = (0, _rows(heads, d))
        rules[f"self_attn.{name}.bias"] = (0, _rows(heads, d))
    rules.update({"self_attn.o_proj.weight": (1, _rows(q, d)), "self_attn.o_proj.bias": ("bias_once",),
                  "mlp.gate_proj.weight": (0, feat), "mlp.up_proj.weight": (0, feat),
                  "mlp.gate_proj.bias": (0, feat), "mlp.up_proj.bias": (0, feat),
                  "mlp.down_proj.weight": (1, feat), "mlp.down_proj.bias": ("bias_once",)})
    return rules


def reduced_modules(layout: Layout) -> tuple[str, str]:
    """The row-parallel modules of a layer: an all-reduce follows each."""
    return ("attn.c_proj", "mlp.c_proj") if layout.arch == "gpt2" else ("self_attn.o_proj", "mlp.down_proj")


def shard_tensors(model, layout: Layout, rank: int) -> dict[str, torch.Tensor | None]:
    """Every parameter and buffer rank ``rank`` holds, by name (tied names share one tensor), on the
    CPU: a contiguous copy of its slice, the whole tensor for a replicated one, ``None`` for a
    row-parallel bias on ranks other than 0 (see :func:`split_rules`)."""
    rules, prefix = split_rules(layout, rank), _prefix(model) + "."
    out: dict[str, torch.Tensor | None] = {}
    copies: dict[int, torch.Tensor] = {}  # tied parameters (an LM head tied to the embeddings) stay tied
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        rule = None
        if name.startswith(prefix):
            rule = rules.get(name[len(prefix):].split(".", 1)[1])  # drop the layer index
        if rule is None:
            if id(tensor) not in copies:
                copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
            out[name] = copies[id(tensor)]
        elif rule[0] == "bias_once":
            out[name] = tensor.detach().to("cpu", copy=True) if rank == 0 else None
        else:
            dim, index = rule
            if isinstance(index, slice):
                out[name] = tensor.detach().narrow(dim, index.start, index.stop - index.start).to("cpu", copy=True)
            else:
                out[name] = tensor.detach().index_select(dim, index.to(tensor.device)).to("cpu", copy=True)
    return out


def load_shard(local, tensors: dict, layout: Layout, device) -> None:
    """Give ``local`` (built from the config on the meta device) the rank's tensors, on ``device``.

    Each tensor replaces the module's own (a smaller one for a split module); the sizes a forward
    reads are set to match (``Linear.in/out_features``, GPT-2's ``Conv1D.nf`` and ``split_size``)."""
    placed: dict[int, torch.Tensor] = {}
    for name, tensor in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = local.get_submodule(owner_name)
        if tensor is None:  # a row-parallel bias on a rank other than 0: added once, by rank 0
            if isinstance(owner, torch.nn.Linear):
                owner.bias = None
            else:  # GPT-2's Conv1D always adds a bias: zeros (adding 0.0 is exact)
                width = tensors[owner_name + ".weight"].shape[1]
                owner.bias = torch.nn.Parameter(torch.zeros(width, dtype=tensors[owner_name + ".weight"].dtype,
                                                            device=device), requires_grad=False)
            continue
        is_param = leaf in dict(owner.named_parameters(recurse=False))
        if id(tensor) not in placed:  # a tied name gets the same object as its twin
            value = tensor.to(device)
            placed[id(tensor)] = torch.nn.Parameter(value, requires_grad=False) if is_param else value
        setattr(owner, leaf, placed[id(tensor)])
    for module in local.modules():
        if isinstance(module, torch.nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        elif type(module).__name__ == "Conv1D":
            module.nx, module.nf = module.weight.shape
        if layout.arch == "gpt2" and hasattr(module, "split_size") and hasattr(module, "c_attn"):
            module.split_size = layout.heads_per_rank * layout.head_dim


def add_all_reduce_hooks(local, layout: Layout, all_reduce) -> list:
    """A forward hook on each row-parallel module: ``all_reduce(output)`` sums the ranks' partial outputs."""
    handles = []
    for block in _blocks(local):
        for name in reduced_modules(layout):
            module = block.get_submodule(name)
            handles.append(module.register_forward_hook(lambda _m, _inp, out: all_reduce(out)))
    return handles
