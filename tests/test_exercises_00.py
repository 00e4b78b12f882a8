"""Self-checks of notebook 00 accept the right answer and explain wrong ones."""
import torch

from cbteach.exercises.ex00 import check_kv_bytes_per_token, check_ratio
from conftest import tiny_model


def test_ex00_kv_bytes(capsys):
    model = tiny_model("llama")  # 2 layers, 2 KV heads of 16 dims, fp32
    assert check_kv_bytes_per_token(model, 2 * 2 * 2 * 16 * 4)
    assert not check_kv_bytes_per_token(model, 2 * 2 * 16 * 4)
    assert "one layer" in capsys.readouterr().out
    assert not check_kv_bytes_per_token(model, 2 * 2 * 4 * 16 * 4)
    assert "query heads" in capsys.readouterr().out
    assert not check_kv_bytes_per_token(model, "512")


def test_ex00_kv_bytes_follows_the_dtype(capsys):
    model = tiny_model("llama").to(torch.bfloat16)  # 2 bytes per element
    assert check_kv_bytes_per_token(model, 2 * 2 * 2 * 16 * 2)
    assert "× 2 bytes (bfloat16)" in capsys.readouterr().out
    assert not check_kv_bytes_per_token(model, 2 * 2 * 2 * 16 * 4)


def test_ex00_ratio():
    assert check_ratio([3, 30, 12], 10.0)
    assert not check_ratio([3, 30, 12], 4.0)
