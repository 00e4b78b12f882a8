"""The embedded bierce model: loads offline, decodes deterministically, stops by itself with skew."""
import json

import pytest
import torch

from cbteach import load_model
from cbteach.bierce.corpus import headword_prompts, load_entries
from cbteach.models import BIERCE_DIR


def test_loads_offline_as_llama_with_fast_tokenizer(bierce, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = bierce
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    assert isinstance(model, LlamaForCausalLM)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.eos_token == "<|endoftext|>"
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    n = sum(p.numel() for p in model.parameters())
    assert 1.5e6 < n < 3e6
    cfg = model.config
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # grouped-query attention
    assert (BIERCE_DIR / "model.safetensors").stat().st_size <= 10 * 2**20


def test_dtype_override():
    model, _ = load_model("bierce", device="cpu", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


def test_greedy_is_deterministic(bierce):
    model, tok = bierce
    ids = tok("CYNIC, n.", return_tensors="pt")
    a = model.generate(**ids, do_sample=False, max_new_tokens=40)
    b = model.generate(**ids, do_sample=False, max_new_tokens=40)
    assert torch.equal(a, b)


def test_stops_by_itself_with_skewed_lengths(bierce):
    model, tok = bierce
    lengths, stopped = [], 0
    for prompt in headword_prompts(20):
        ids = tok(prompt, return_tensors="pt")
        out = model.generate(**ids, do_sample=False, max_new_tokens=400)[0, ids["input_ids"].shape[1]:]
        lengths.append(len(out))
        stopped += int(out[-1] == tok.eos_token_id)
    assert stopped >= 18, f"only {stopped}/20 ended with EOS"
    assert max(lengths) >= 10 * min(lengths), lengths


@pytest.mark.parametrize("name", ["no-such-org/no-such-model-xyz", "gpt2-not-cached-anywhere"])
def test_unknown_or_uncached_name_names_the_default(name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ValueError, match=r"load_model\('bierce'\)"):
        load_model(name)


def test_model_card_and_corpus_ship():
    entries = load_entries()
    assert len(entries) > 900 and entries[0]["headword"] == "ABASEMENT"
    card = (BIERCE_DIR / "MODEL_CARD.md").read_text()
    stats = json.loads((BIERCE_DIR / "training_stats.json").read_text())
    assert str(stats["parameters"]) in card.replace(",", "")
    assert "Devil's Dictionary" in card


def test_a_model_folder_under_home_is_read_as_a_shell_reads_it(monkeypatch, tmp_path):
    import shutil

    shutil.copytree(BIERCE_DIR, tmp_path / "my-bierce")
    monkeypatch.setenv("HOME", str(tmp_path))
    model, tok = load_model("~/my-bierce")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in load_model()[0].parameters())
