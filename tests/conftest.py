"""Shared fixtures: tiny random-weight models of the three architectures, and the reference.

The reference is always transformers' own ``model.generate`` on one prompt at a time -- never an
earlier output of cbteach.
"""
import os
import signal
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import cbteach  # noqa: E402,F401  (first: where no GPU is, Triton's interpreter is chosen before transformers imports it)

import pytest  # noqa: E402  (the offline switches above must be set before transformers is imported)
import torch  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,  # noqa: E402
                          Qwen2ForCausalLM)

torch.set_num_threads(1)  # tiny models: one thread is as fast, and runs side by side stay predictable

# A shell starts a background job (`make test &` in a script) with SIGINT ignored, and every process the
# tests start would inherit that: a server signalled with SIGINT before its own handler is in place (while
# Python starts) would ignore it and run on. The tests that send SIGINT play a user at a terminal, where
# Ctrl-C is not ignored; so this session restores Python's own handler, and its children start with the
# default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# -- a loaded machine, made on purpose: pytest --busy N ----------------------------------------------------
# What `benchmarks/serve/run_serve_bench.py --busy N` does for the serve benchmark: N processes that loop in
# Python for the whole session, so that a race between processes shows up here rather than on a learner's
# busy laptop or a shared CI machine (`make test-busy`). Each loop also ends by itself once its parent is
# no longer this pytest (its pid is passed, not read at the loop's start: pytest may be gone by then), so
# even a killed session leaves none behind.
BUSY_LOOP = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    for _ in range(1_000_000):\n        pass\n"


def pytest_addoption(parser):
    parser.addoption("--busy", type=int, default=0, metavar="N",
                     help="load the machine with N busy-looping processes for the whole session (make test-busy)")


def pytest_configure(config):
    n = config.getoption("busy")
    if n < 0:
        raise pytest.UsageError(f"--busy takes a number of processes >= 0, got {n}")
    config.busy_procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())]) for _ in range(n)]


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"


def pytest_report_header(config):
    procs = getattr(config, "busy_procs", [])
    busy = f"{len(procs)} busy-looping processes beside the tests; " if procs else ""
    return f"{busy}load average {_load()} on {os.cpu_count()} processors"


def pytest_terminal_summary(terminalreporter, config):
    procs = getattr(config, "busy_procs", [])
    busy = f"{len(procs)} busy-looping processes beside the tests; " if procs else ""
    terminalreporter.write_line(f"{busy}load average at the end {_load()} on {os.cpu_count()} processors")


def pytest_unconfigure(config):
    for p in getattr(config, "busy_procs", []):
        p.kill()
        p.wait()


EOS = 5  # a token id inside the tiny vocabularies, so random models do stop by themselves sometimes
VOCAB = 97
ARCHS = ("gpt2", "llama", "qwen2")


def tiny_model(arch: str, attn: str = "sdpa", seed: int = 0):
    """A 2-layer random-weight model; GQA for Llama and Qwen2, learned positions for GPT-2."""
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                         eos_token_id=EOS, bos_token_id=1)
        cls = GPT2LMHeadModel
    elif arch == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          eos_token_id=EOS, bos_token_id=1, pad_token_id=EOS)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                          eos_token_id=EOS, bos_token_id=1, pad_token_id=EOS)
        cls = Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    return model


def reference(model, prompt_ids, max_new_tokens, eos_id=EOS):
    """Greedy per-prompt ``generate``: the ground truth every strategy must reproduce."""
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="session")
def bierce():
    from cbteach import load_model

    return load_model("bierce", device="cpu")


def step_until(eng, done, what: str, max_steps: int = 2000) -> list:
    """Step ``eng`` until ``done()`` holds; the step records. An idle step (nothing had arrived) moves
    on to the next arrival. Never loops forever: after ``max_steps`` steps it fails, saying what it
    waited for -- a test must not hang, whatever the machine's speed."""
    records = []
    for _ in range(max_steps):
        if done():
            return records
        rec = eng.step()
        records.append(rec)
        if rec.idle:
            eng.wait_for_arrival()
    if done():
        return records
    raise AssertionError(f"still waiting for {what} after {max_steps} steps")


def drain(eng, max_steps: int = 5000) -> list:
    """Step ``eng`` until every request is done (bounded, as :func:`step_until`)."""
    return step_until(eng, lambda: not eng.has_unfinished(), "every request to finish", max_steps)


def sim_clock(step_time: float = 0.01):
    """A simulated engine clock on which every step costs ``step_time`` seconds: arrivals land on
    the same steps whatever the machine's speed."""
    from cbteach.core.clock import VirtualClock

    return VirtualClock(step_time=step_time)
