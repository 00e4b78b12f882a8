"""Tensor parallelism under torchrun: rank 0 holds the engine, the other ranks serve.

    torchrun --nproc-per-node 2 benchmarks/tp/torchrun_check.py [--model bierce|llama|qwen2|gpt2]

Rank 0 runs a few requests with Engine(..., tensor_parallel_size=WORLD_SIZE) and checks every greedy
token against the single-process engine's on the same model; it prints one line per request and
"torchrun tp: N/N equal". Exit status 1 if any differs.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))


def build(name):
    if name == "bierce":
        from cbteach import load_model

        return load_model("bierce", device="cpu")
    from conftest import tiny_model

    return tiny_model(name)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bierce")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build(args.model)
    from cbteach.executor.torchrun import serve_rank

    if serve_rank(model):  # ranks 1..N-1 serve until rank 0 closes its engine
        return 0
    from cbteach import Engine
    from cbteach.core.request import Request

    world = int(os.environ["WORLD_SIZE"])
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [3] * 13, [11, 12]]
    reqs = lambda: [Request(p, 12, request_id=i) for i, p in enumerate(prompts)]  # noqa: E731
    single = Engine(model, None, max_batch_size=4, kv="paged", block_size=4).run(reqs())
    with Engine(model, None, max_batch_size=4, kv="paged", block_size=4, tensor_parallel_size=world) as eng:
        outs = eng.run(reqs())
    same = [a.output_ids == b.output_ids for a, b in zip(outs, single)]
    for i, (o, ok) in enumerate(zip(outs, same)):
        print(f"request {i}: {o.output_ids} {'equal' if ok else 'DIFFERS'}")
    print(f"torchrun tp: {sum(same)}/{len(same)} equal")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
