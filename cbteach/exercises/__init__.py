"""Self-checks for the notebooks' exercises, one module per notebook (``ex00`` for notebook 00 ...).

Each check takes the learner's answer, compares it with a value computed from the real engine or
model, prints what is right or exactly what is wrong, and returns ``True``/``False``. Solutions are
in the notebooks (cells tagged ``solution``), never here.
"""


def report(ok: bool, good: str, bad: str) -> bool:
    print(("✓ " + good) if ok else ("✗ " + bad))
    return ok
