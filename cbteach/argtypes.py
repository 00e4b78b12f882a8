"""argparse types the command lines share: numbers with a bound, refused in one line when they miss it.

``number(int, 0)`` takes ``"8"`` and refuses ``"0"``, ``"-3"``, ``"x"``, ``"nan"`` and ``"inf"`` with
``'0' is not an integer > 0``: argparse prints it as ``error: argument --requests: ...``, naming the
option, and exits 2 -- never a traceback several frames deep in the code that got the bad value.
(It sits on the package's lowest floor so every command, from bierce's trainer up, can use it.) And
:func:`unwritable`: an output path checked before a long run, not after it.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path


def number(kind, low, strict: bool = True):
    """An argparse type: a finite ``kind`` (int or float) above ``low`` (``strict``) or at least ``low``."""
    def parse(text):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            value = None
        if value is None or not math.isfinite(value) or (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'} "
                                             f"{'>' if strict else '>='} {low}")
        return value
    parse.__name__ = f"{kind.__name__} {'>' if strict else '>='} {low}"  # what argparse says if parse itself fails
    return parse


POSITIVE_INT, POSITIVE = number(int, 0), number(float, 0)


def at_most(parse, most):
    """An argparse type: what ``parse`` takes, up to ``most``."""
    def bounded(text):
        value = parse(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"{value:,} is more than {most:,}")
        return value
    bounded.__name__ = f"{parse.__name__}, <= {most}"
    return bounded


def threads(text):
    """``--threads``: an integer from 1 to four per core this machine has (past that they only wait for each other;
    100,000 made torch's and the tokenizer's thread pools fail to start, and the process crash)."""
    value = POSITIVE_INT(text)
    most = 4 * (os.cpu_count() or 1)
    if value > most:
        raise argparse.ArgumentTypeError(f"{value} threads is more than 4 per core of this machine's "
                                         f"{os.cpu_count() or 1} (at most {most})")
    return value


def unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written (None: it can): a folder there, a parent that cannot be made, or a file
    that cannot be made in it -- tried for real (a temporary file, removed at once), since permission bits say
    nothing for root and nothing at all in /proc."""
    if path.is_dir():
        return "it is a folder; give a file name"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with open(path, "ab"):  # (appends nothing: the file is left as it is)
                pass
        else:
            with tempfile.TemporaryFile(dir=path.parent):
                pass
    except OSError as e:
        return e.strerror or str(e)
    return None
