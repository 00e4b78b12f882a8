"""Side by side with a peer: llm-analysis (Li, 2023; pip install llm-analysis) on one workload.

    pip install --no-deps --target /tmp/peer llm-analysis==0.2.2 fire==0.5.0 termcolor
    PYTHONPATH=/tmp/peer python benchmarks/sim/peer_compare.py

(--no-deps: llm-analysis pins transformers 4.31, which would replace the course's; its analysis needs
none of its dependencies for the shipped model and GPU configs. Never committed: only its answers are,
in cbteach/sim/data/peer_llm_analysis.json, which notebook 13 reads.)

The workload is static, as llm-analysis models it: a batch of 8 prompts of 512 tokens on OPT-13B,
A100-SXM-40GB, fp16, generating 128 tokens each. Both tools are given the same achieved fractions of
peak (60% of FLOPs, 80% of bandwidth) so what differs is the models themselves.
"""
import json
import os

from llm_analysis.analysis import infer

from cbteach.sim import CostModel, get_device

BATCH, PROMPT, NEW, MFU, MBU = 8, 512, 128, 0.6, 0.8
OUT = os.path.join(os.path.dirname(__file__), "..", "..", "cbteach", "sim", "data", "peer_llm_analysis.json")


def main():
    peer = infer(model_name="facebook_opt-13b", gpu_name="a100-sxm-40gb", batch_size_per_gpu=BATCH, seq_len=PROMPT,
                 num_tokens_to_generate=NEW, flops_efficiency=MFU, hbm_memory_efficiency=MBU, log_level="ERROR")
    keys = ("prefill_latency", "decode_latency", "total_decode_latency", "total_latency",
            "prefill_latency_fwd_attn", "prefill_latency_fwd_mlp", "decode_latency_fwd_attn", "decode_latency_fwd_mlp",
            "kv_cache_latency")
    out = {"tool": "llm-analysis 0.2.2", "model": "facebook_opt-13b", "gpu": "a100-sxm-40gb", "batch": BATCH,
           "prompt": PROMPT, "new_tokens": NEW, "flops_efficiency": MFU, "hbm_memory_efficiency": MBU,
           "peer": {k: peer[k] for k in keys}}
    ours = CostModel("opt-13b", get_device("a100-40gb").with_(mfu=MFU, mbu=MBU))
    decode = [ours.step([PROMPT + k] * BATCH, [1] * BATCH).total for k in range(NEW - 1)]
    out["cbteach"] = {"prefill_latency": ours.step([0] * BATCH, [PROMPT] * BATCH).total,
                      "decode_latency_mean": sum(decode) / len(decode), "total_decode_latency": sum(decode)}
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
