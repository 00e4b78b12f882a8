"""Self-checks of notebook 05 accept the right answer and explain wrong ones."""
from cbteach.exercises.ex05 import check_slot


def test_ex05_slot(capsys):
    assert check_slot(11 * 16 + 5, 3)
    assert not check_slot(2 * 16 + 5, 3)
    assert "table index" in capsys.readouterr().out
    assert not check_slot(11 * 16 + 5, 0)
    assert "empty=0 is wrong" in capsys.readouterr().out
