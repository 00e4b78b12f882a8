"""Tensor parallelism (cbteach.parallel): two real worker processes joined by torch.distributed (gloo).

Greedy tokens must equal per-prompt ``model.generate`` and the single-process engine's, on GPT-2,
Llama (GQA) and Qwen2 (one KV head, replicated on both ranks) and bierce; bad configurations are
refused before any process starts; a rank that dies ends the engine with an error, never a hang;
nothing is left running. Every engine is closed in ``finally``.
"""
import os
import signal
import time

import pytest
import torch
from conftest import EOS, reference, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from cbteach import Engine
from cbteach.core.request import Request
from cbteach.parallel import tp as tp_module
from cbteach.parallel.procs import WorkerDied
from cbteach.parallel.shard import layout_for, shard_tensors
from cbteach.core.scheduler_output import RunnerOutput
from cbteach.core.scheduler_output import SchedulerOutput
from cbteach.executor.multiproc import MultiprocExecutor

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [3] * 13, [11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [6]]


def tp_engine(model, tokenizer=None, n=2, **options):
    options.setdefault("kv", "paged")
    return Engine(model, tokenizer, tensor_parallel_size=n, **options)


def close(eng):
    eng.close()


def requests(max_new=10):
    return [Request(p, max_new, request_id=i) for i, p in enumerate(PROMPTS)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_tokens_equal_generate_and_single_process(arch):
    model = tiny_model(arch)
    opts = dict(max_batch_size=4, block_size=4, num_blocks=24, token_budget=8)  # chunked prefills, a tight pool
    single = Engine(model, None, kv="paged", **opts).run(requests())
    eng = tp_engine(model, **opts)
    try:
        outs = eng.run(requests())
        comm, memory, procs = list(eng.executor.comm_log), eng.executor.memory, list(eng.executor.group.procs)
        records = [r for r in eng.records if r.seqs]
    finally:
        close(eng)
        close(eng)  # idempotent
    assert not any(p.is_alive() for p in procs)  # nothing left running
    for p, o, s in zip(PROMPTS, outs, single):
        assert o.output_ids == reference(model, p, 10, EOS), (arch, p)
        assert o.output_ids == s.output_ids
    layout = layout_for(model, 2)
    hidden = layout.hidden_size
    # One all-reduce after attention and one after the MLP of every layer; each carries the step's
    # hidden states (tokens x hidden x 4 bytes in fp32).
    assert all(c["all_reduces"] == 2 * layout.num_layers for c in comm)
    assert all(c["all_reduce_bytes"] == 2 * layout.num_layers * c["num_tokens"] * hidden * 4 for c in comm)
    assert all(r.num_all_reduces == 2 * layout.num_layers for r in records)  # in the step records too
    assert all(r.all_reduce_bytes == 2 * layout.num_layers * r.num_tokens * hidden * 4 for r in records)
    full = sum(p.numel() * 4 for p in model.parameters())
    assert all(m["weight_bytes"] < full for m in memory)
    assert [m["q_heads"] for m in memory] == [[0, 1], [2, 3]]
    if arch == "qwen2":  # one KV head, two ranks: each holds a copy
        assert [m["kv_heads"] for m in memory] == [[0], [0]]


@pytest.mark.timeout(180)
def test_bierce_with_forked_samples_and_prefix_caching(bierce):
    """bierce (6 heads, 2 KV heads: one per rank) on prompts sharing a prefix, two of them sampled twice
    with forks that share their prompt's blocks: copy-on-write copies and cached prefix blocks are made
    and read on every rank's pool (the plan carries the copies)."""
    from cbteach import SamplingParams

    bierce, tok = bierce
    prompts = ["The devil's dictionary defines LOVE, n.", "The devil's dictionary defines BORE, n.", "Politics:"]
    sp = [SamplingParams(n=2, temperature=1.0, seed=3), None, SamplingParams(n=2, temperature=0.8, seed=4)]
    reqs = lambda: [Request(p, 16, request_id=i, **({"sampling_params": s} if s else {}))  # noqa: E731
                    for i, (p, s) in enumerate(zip(prompts, sp))]
    # two slots: request 0's two samples run first, request 1 then finds their prompt's blocks cached
    opts = dict(max_batch_size=2, kv="paged", block_size=4, parallel_sampling="fork", prefix_caching=True)
    single = Engine(bierce, tok, **opts).run(reqs())
    eng = tp_engine(bierce, tok, **opts)
    try:
        outs = eng.run(reqs())
        memory, usage = eng.executor.memory, eng.kv_usage()
    finally:
        close(eng)
    tokens = lambda c: [s.output_ids for s in c.samples] if c.samples else c.output_ids  # noqa: E731
    assert [tokens(o) for o in outs] == [tokens(s) for s in single]
    assert usage["num_cow_copies"] > 0 and usage["prefix_hits"] > 0
    assert [m["kv_heads"] for m in memory] == [[0], [1]]
    assert [m["q_heads"] for m in memory] == [[0, 1, 2], [3, 4, 5]]


def _no_tensor(x, path="out"):
    """Raise AssertionError naming the first tensor inside ``x`` (what crosses must be plain data)."""
    if isinstance(x, torch.Tensor):
        raise AssertionError(f"{path} is a tensor")
    if isinstance(x, (list, tuple, set, frozenset)):
        for i, v in enumerate(x):
            _no_tensor(v, f"{path}[{i}]")
    elif isinstance(x, dict):
        for k, v in x.items():
            _no_tensor(v, f"{path}[{k!r}]")
    elif hasattr(x, "__dataclass_fields__"):
        for name in x.__dataclass_fields__:
            _no_tensor(getattr(x, name), f"{path}.{name}")


@pytest.mark.timeout(180)
def test_only_the_message_goes_out_and_only_token_ids_come_back(monkeypatch):
    """vLLM V1's arrangement: every rank gets the scheduler's message and nothing else, runs it and samples
    for itself; only rank 0 answers, with token ids -- no logits, no appended tokens, no per-rank reports."""
    from cbteach import SamplingParams
    from cbteach.parallel import procs

    model = tiny_model("llama")
    sent, received = [], []
    send, recv = procs.send, procs.recv
    monkeypatch.setattr(procs, "send", lambda conn, obj: (sent.append((conn, obj)), send(conn, obj))[1])
    monkeypatch.setattr(procs, "recv", lambda conn: (lambda o: (received.append((conn, o)), o)[1])(recv(conn)))
    reqs = [Request(p, 8, request_id=i, sampling_params=SamplingParams(temperature=0.9, seed=i) if i % 2 else
                    SamplingParams()) for i, p in enumerate(PROMPTS)]
    single = Engine(model, None, kv="paged", max_batch_size=3, block_size=4).run(reqs)
    eng = tp_engine(model, max_batch_size=3, block_size=4)
    try:
        conns = list(eng.executor.group.conns)
        sent.clear(), received.clear()  # the start (each rank's shard, its "ready") is not a step
        outs = eng.run(reqs)
    finally:
        close(eng)
    assert [o.output_ids for o in outs] == [s.output_ids for s in single]  # seeded sampling agrees across ranks
    steps = [obj for conn, obj in sent if obj is not None]
    assert steps and all(isinstance(obj, SchedulerOutput) for obj in steps)
    assert all(conn in conns for conn, _ in sent)
    assert {conns.index(conn) for conn, _ in received} == {0}, "a rank other than 0 answered a step"
    assert len(received) == len(steps) // len(conns)  # one answer per step, rank 0's
    for _, (kind, out) in received:
        assert kind == "ok" and isinstance(out, RunnerOutput)
        _no_tensor(out)
        assert all(t is None or all(isinstance(x, int) for x in t) for t in out.sampled)


@pytest.mark.timeout(180)
def test_v0_swap_runs_on_every_rank_from_the_message():
    """V0's swap is fields of the message (``V0SchedulerOutput``), so every rank copies its own heads' blocks
    to host memory and back: swap preemption under tensor parallelism stays exact."""
    model = tiny_model("llama")
    reqs = [Request([5 + i, 6, 7, 8, 9 + i], 14, request_id=i, ignore_eos=True) for i in range(6)]
    eng = tp_engine(model, max_batch_size=4, block_size=4, num_blocks=9, preemption="swap")
    try:
        outs = eng.run(reqs)
        swapped_in = sum(len(r.swapped_in) for r in eng.records)
    finally:
        close(eng)
    assert swapped_in >= 2, "the workload was meant to swap"
    for r, o in zip(reqs, outs):
        assert o.output_ids == reference(model, r.prompt, 14)


@pytest.mark.timeout(120)
def test_a_dead_rank_ends_the_engine_with_an_error():
    model = tiny_model("llama")
    eng = tp_engine(model, max_batch_size=2, block_size=4)
    procs = list(eng.executor.group.procs)
    try:
        for r in requests(30)[:2]:
            eng.add_request(r)
        eng.step()
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied, match="rank 1"):
            for _ in range(50):  # bounded: the first step after the kill raises
                eng.step()
        assert time.monotonic() - t0 < 60  # a bound on the error path, not a speed check
        with pytest.raises(WorkerDied):
            eng.step()  # and the engine stays stopped
    finally:
        close(eng)
    assert not any(p.is_alive() for p in procs)


# -- refused before any process starts -------------------------------------------------------------
@pytest.fixture
def no_processes(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a worker process was started for a configuration that should be refused")

    from cbteach.executor import multiproc

    monkeypatch.setattr(multiproc, "WorkerGroup", refuse)


def _runner(model, n, **opts):
    opts.setdefault("kv", "paged")
    return Engine(model, None, max_batch_size=2, tensor_parallel_size=n, **opts)


def _llama(heads, kv_heads, hidden=48):
    cfg = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("model, n, match", [
    (lambda: tiny_model("llama"), 3, "4 attention heads do not divide among 3"),
    (lambda: tiny_model("gpt2"), 8, "more ranks than the model's 4 attention heads"),
    (lambda: _llama(12, 4), 6, "multiple of 4"),  # 4 KV heads, 6 ranks: cannot replicate evenly
    (lambda: _llama(12, 6), 4, "6 KV heads do not divide among 4"),
    (lambda: tiny_model("llama"), 0, "tensor_parallel_size"),
    (lambda: tiny_model("llama"), True, "tensor_parallel_size"),
])
def test_bad_layouts_refused(no_processes, model, n, match):
    with pytest.raises(ValueError, match=match):
        _runner(model(), n)


def test_bad_engine_settings_refused(no_processes):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kv='paged'"):
        _runner(model, 2, kv="concat")
    eng = Engine(model, None, max_batch_size=2, kv="paged")
    with pytest.raises(ValueError, match="'nccl' needs a CUDA model"):
        MultiprocExecutor(model, eng.info, eng.kv, tp_module.ParallelConfig(2, backend="nccl"))
    with pytest.raises(ValueError, match="backend must be"):
        tp_module.ParallelConfig(2, backend="mpi")


def test_unknown_architecture_refused(no_processes):
    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(OPTConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                                   num_attention_heads=4, max_position_embeddings=64)).eval()
    with pytest.raises(ValueError, match="shards llama, qwen2, gpt2"):
        _runner(opt, 2)


# -- the shards themselves (no processes) ----------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_shards_rebuild_the_layer(arch):
    """Rank 0's and rank 1's shards put together are the original weights; a row-parallel bias is kept
    once (rank 0) so the all-reduce adds it once."""
    model = tiny_model(arch)
    layout = layout_for(model, 2)
    s0, s1 = shard_tensors(model, layout, 0), shard_tensors(model, layout, 1)
    full = dict(model.named_parameters(remove_duplicate=False))
    if arch == "gpt2":
        w = full["transformer.h.0.attn.c_attn.weight"]  # [E, 3E]: q | k | v
        e = layout.hidden_size
        parts = [torch.cat([s["transformer.h.0.attn.c_attn.weight"][:, i * e // 2:(i + 1) * e // 2]
                            for s in (s0, s1)], dim=1) for i in range(3)]
        assert torch.equal(torch.cat(parts, dim=1), w)
        assert s1["transformer.h.0.attn.c_proj.bias"] is None and s0["transformer.h.0.attn.c_proj.bias"] is not None
        down = "transformer.h.0.mlp.c_proj.weight"
        assert torch.equal(torch.cat([s0[down], s1[down]], dim=0), full[down])
    else:
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(torch.cat([s0[q], s1[q]], dim=0), full[q])
        o = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(torch.cat([s0[o], s1[o]], dim=1), full[o])
        k = "model.layers.0.self_attn.k_proj.weight"
        if layout.num_kv_heads < 2:  # replicated: both ranks hold the whole KV head
            assert torch.equal(s0[k], full[k]) and torch.equal(s1[k], full[k])
        else:
            assert torch.equal(torch.cat([s0[k], s1[k]], dim=0), full[k])
    emb = model.get_input_embeddings().weight
    name = next(n for n, p in full.items() if p is emb)
    assert torch.equal(s1[name], emb)  # embeddings replicated


def test_gqa_replication_rule():
    layout = layout_for(_llama(8, 2, hidden=64), 4)  # 2 KV heads, 4 ranks: each KV head on 2 ranks
    assert [list(layout.kv_heads(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(layout.q_heads(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    group = layout.num_heads // layout.num_kv_heads
    for r in range(4):  # every query head a rank computes reads a KV head that rank holds
        assert all(h // group in layout.kv_heads(r) for h in layout.q_heads(r))


@pytest.mark.timeout(180)
def test_runs_under_torchrun():
    """``torchrun --nproc-per-node 2``: rank 0 holds the engine, rank 1 serves (benchmarks/tp/torchrun_check.py)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this Python")
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(root / "benchmarks/tp/torchrun_check.py"),
                           "--model", "qwen2"], capture_output=True, text=True, timeout=150, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torchrun tp: 4/4 equal" in proc.stdout


@pytest.mark.timeout(180)
def test_async_scheduling_with_tensor_parallelism_equals_one_process():
    """Async scheduling through the executor on two gloo ranks: each rank keeps a step in flight, rank 0
    answers with the step before's output; the tokens are one process's, and generate's."""
    model = tiny_model("llama")
    opts = dict(max_batch_size=4, block_size=4, num_blocks=24, token_budget=8)  # chunks and a tight pool
    single = Engine(model, None, kv="paged", **opts).run(requests())
    eng = tp_engine(model, async_scheduling=True, **opts)
    try:
        outs = eng.run(requests())
        usage = eng.kv_usage()
        procs = list(eng.executor.group.procs)
    finally:
        close(eng)
    assert not any(p.is_alive() for p in procs)
    for p, o, s in zip(PROMPTS, outs, single):
        assert o.output_ids == s.output_ids == reference(model, p, 10, EOS), p
    assert usage["num_used_blocks"] == 0


@pytest.mark.timeout(180)
def test_speculative_decoding_with_tensor_parallelism_equals_generate():
    """Every rank builds the speculative runner (the message carries the guesses; a rank without it would
    feed them and keep the wrong logits): prompts that repeat themselves, so prompt lookup guesses and
    some guesses are kept, and the tokens are generate's."""
    model = tiny_model("llama")
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4], [9, 8, 7, 9, 8, 7], [3] * 13, [11, 12]]
    eng = tp_engine(model, max_batch_size=4, block_size=4, num_blocks=24, speculative="ngram")
    try:
        outs = eng.run([Request(p, 10, request_id=i) for i, p in enumerate(prompts)])
        stats = eng.spec_stats
    finally:
        close(eng)
    for p, o in zip(prompts, outs):
        assert o.output_ids == reference(model, p, 10, EOS), p
    assert stats["accepted"] > 0 and stats["verify_steps"] > 0
