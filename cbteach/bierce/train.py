"""Train "bierce", the course's embedded model, from scratch on the CPU.

    python -m cbteach.bierce.train            # writes ./bierce/: tokenizer.json, config.json, model.safetensors
    python -m cbteach.bierce.train --draft    # bierce's draft model in ./bierce-draft/ (bierce's tokenizer)
    python -m cbteach.bierce.train --out cbteach/bierce    # from a checkout: replace the shipped model

Nothing is written into the installed package unless ``--out`` says so. ``--corpus`` trains on
another ``corpus.jsonl`` (default: the shipped one, see :mod:`cbteach.bierce.corpus`).

What gets built, and why each choice:

* **Tokenizer** -- byte-level BPE (GPT-2 style) with a 2,048-token vocabulary, trained with
  ``tokenizers`` on the corpus. ``<|endoftext|>`` is the only special token and doubles as EOS.
* **Model** -- transformers' ``LlamaForCausalLM`` (RoPE, grouped-query attention, RMSNorm, SwiGLU),
  4 layers, hidden size 192, 6 query heads sharing 2 KV heads, tied embeddings: about 2M
  parameters. Using a stock architecture means every engine path in the course is exercised on
  the same code a real Llama runs.
* **Data** -- one dictionary entry per document, EOS after each. Training windows mostly start at
  an entry's first token, so a bare headword prompt such as ``"CYNIC, n."`` at position 0 looks
  exactly like training data, and the model learns when an entry is over.

* **Draft model** (``--draft``) -- the same script and data, a model a fifth of bierce's size
  (2 layers, hidden size 96, 3 query heads, 1 KV head), trained on bierce's *own* tokenizer (a
  draft must speak the target's vocabulary: speculative decoding compares token ids). It is the
  small, fast guesser for ``Engine(..., speculative=load_draft_model())`` (notebook 08).

The seed is fixed; the run is deterministic on one machine (thread scheduling may change the last
digits elsewhere). The README records how long it took on the course's 2-core reference machine.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from .corpus import CORPUS_PATH, HERE, load_entries

EOS = "<|endoftext|>"
VOCAB_SIZE = 2048


def train_tokenizer(texts: list[str], out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   pad_token=EOS, model_max_length=4096)
    fast.save_pretrained(out_dir)
    return fast


SIZES = {"bierce": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                        num_key_value_heads=2),
         "draft": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
                       num_key_value_heads=1)}


def make_model(vocab_size: int, eos_id: int, size: str = "bierce"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, **SIZES[size], max_position_embeddings=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    return LlamaForCausalLM(config)


def batches(docs: list[list[int]], seq_len: int, batch_size: int, rng: random.Random):
    """Yield ``[batch, seq_len + 1]`` windows over the EOS-joined stream of documents.

    Three windows in four start at a document's first token (what a headword prompt looks like);
    the rest start anywhere, so the middles of long entries are trained too.
    """
    stream: list[int] = []
    starts: list[int] = []
    for doc in docs:
        starts.append(len(stream))
        stream.extend(doc)
    stream_t = torch.tensor(stream)
    while True:
        rows = []
        for _ in range(batch_size):
            if rng.random() < 0.75:
                s = rng.choice(starts)
            else:
                s = rng.randrange(0, len(stream) - seq_len - 1)
            s = min(s, len(stream) - seq_len - 1)
            rows.append(stream_t[s : s + seq_len + 1])
        yield torch.stack(rows)


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
        return value
    return parse


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cbteach.bierce.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="default: ./bierce (./bierce-draft with --draft)")
    p.add_argument("--corpus", type=Path, default=CORPUS_PATH, help="corpus.jsonl (default: the shipped one)")
    p.add_argument("--tokenizer", type=Path, default=HERE,
                   help="--draft: the folder of the target's tokenizer (default: the shipped bierce)")
    p.add_argument("--draft", action="store_true", help="train the small draft model on bierce's tokenizer")
    p.add_argument("--steps", type=_positive(int), default=900)
    p.add_argument("--seq-len", type=_positive(int), default=384)
    p.add_argument("--batch-size", type=_positive(int), default=16)
    p.add_argument("--lr", type=_positive(float), default=3e-3)
    p.add_argument("--seed", type=int, default=1911)
    p.add_argument("--threads", type=_positive(int), default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if not args.corpus.is_file():
        p.error(f"{args.corpus} not found: build it with `python -m cbteach.bierce.corpus --out {args.corpus}`")
    if args.draft and not (args.tokenizer / "tokenizer.json").is_file():
        p.error(f"no tokenizer.json in {args.tokenizer}: --draft trains on the target's tokenizer; "
                "give its folder with --tokenizer")
    if args.threads:
        torch.set_num_threads(args.threads)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()

    try:
        texts = [e["text"] for e in load_entries(args.corpus)]
    except (ValueError, KeyError) as err:
        p.error(f"{args.corpus} is not a corpus.jsonl of {{'headword', 'pos', 'text'}} lines ({err!r})")
    args.out = args.out or Path("bierce-draft" if args.draft else "bierce")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        p.error(f"cannot write to {args.out}: {err.strerror or err}")
    if args.draft:  # the target's tokenizer, as it is: the draft's token ids must mean the same
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = train_tokenizer(texts, args.out)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    docs = [tokenizer(t)["input_ids"] + [eos_id] for t in texts]
    lengths = sorted(len(d) for d in docs)
    print(f"{len(docs)} entries, {sum(lengths)} tokens, median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}")

    model = make_model(len(tokenizer), eos_id, "draft" if args.draft else "bierce")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    warmup = 100

    def lr_at(step):  # linear warm-up, then cosine decay to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    data = batches(docs, args.seq_len, args.batch_size, rng)
    ema = None
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        batch = next(data)
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
        # transformers shifts labels by one inside the loss; we pass the window without its last token.
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = out.loss.item() if ema is None else 0.98 * ema + 0.02 * out.loss.item()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {out.loss.item():.3f}  (ema {ema:.3f})  {time.time() - t0:.0f}s",
                  flush=True)

    model.eval()
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(args.out, safe_serialization=True)
    stats = {"parameters": n_params, "final_loss_ema": round(ema, 4), "steps": args.steps,
             "seq_len": args.seq_len, "batch_size": args.batch_size, "seed": args.seed,
             "train_tokens": sum(lengths), "seconds": round(time.time() - t0)}
    (args.out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats))


if __name__ == "__main__":
    sys.exit(main())
