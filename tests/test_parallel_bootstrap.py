"""A script that makes a tensor-parallel Engine without the `if __name__ == "__main__":` guard: each
spawned worker re-runs it and Python stops the worker in its bootstrap. The driver must say so with a
WorkerDied naming the cause -- not a bare BrokenPipeError."""
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent('''
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from cbteach import Engine

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    engine = Engine(model, None, max_batch_size=2, kv="paged", tensor_parallel_size=2)  # no main guard
    print("STARTED")
    engine.close()
''')


def test_missing_main_guard_is_named(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cbteach.parallel.procs.WorkerDied") or "WorkerDied" in last, proc.stderr[-2000:]
    assert 'if __name__ == "__main__":' in last and "BrokenPipeError" not in last
