"""The Devil's Dictionary as a training corpus: one dictionary entry per document.

Ambrose Bierce's *The Devil's Dictionary* (1911, public domain) is a good toy corpus for a
course on batching because its entries vary wildly in length: "CYNIC, n." gets one line,
"EXECUTIVE, n." gets a page of dialogue. A model trained on one entry per document, with an
end-of-text token after each, learns to stop by itself -- and so produces exactly the skewed
output lengths that continuous batching exploits.

The cleaned corpus ships with the package (``corpus.jsonl``), so nothing here needs the network.
``python -m cbteach.bierce.corpus`` rebuilds it from the Debian package ``dict-devil``
(``apt-get install dict-devil``), which carries the text in dictd format. It writes
``./corpus.jsonl`` unless told otherwise (``--out``), never into an installed package by default;
from a checkout, ``--out cbteach/bierce/corpus.jsonl`` replaces the shipped corpus.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
CORPUS_PATH = HERE / "corpus.jsonl"
DICTD_PATH = Path("/usr/share/dictd/devil.dict.dz")

# An entry starts at the left margin with an upper-case headword, a comma and a part of speech:
# "CYNIC, n.", "ABORIGINIES, n.", "ANOINT, v.t.", "ALL, adj.", "ANY, ..." .
_HEADWORD = re.compile(r"^([A-Z][A-Z0-9' .&-]*[A-Z.]), ([a-z][a-z. ]*\.)")


def split_entries(text: str) -> list[dict]:
    """Split the dictionary's text into entries ``{"headword", "pos", "text"}``."""
    entries: list[dict] = []
    current: list[str] | None = None
    for line in text.splitlines():
        match = _HEADWORD.match(line)
        if match:
            if current is not None:
                entries.append(current)
            current = [line]
        elif current is not None:
            current.append(line)
    if current is not None:
        entries.append(current)

    out = []
    for lines in entries:
        body = "\n".join(line.rstrip() for line in lines).strip()
        match = _HEADWORD.match(body)
        out.append({"headword": match.group(1), "pos": match.group(2), "text": body})
    return out


def build(dictd_path: Path = DICTD_PATH, out_path: Path = Path("corpus.jsonl")) -> list[dict]:
    """Build ``corpus.jsonl`` at ``out_path`` from the dictd file of the Debian package ``dict-devil``.
    Raises FileNotFoundError / ValueError, with what to do, when the input is missing or not that file."""
    if not dictd_path.is_file():
        raise FileNotFoundError(f"{dictd_path} not found: install it with `apt-get install dict-devil`, "
                                "or give the file with --dictd")
    try:
        raw = gzip.decompress(dictd_path.read_bytes()).decode("latin-1")
    except (OSError, EOFError) as err:
        raise ValueError(f"{dictd_path} is not a gzip'd dictd file ({err})") from None
    # Skip the dictd header and the preface: the dictionary proper starts at "ABASEMENT, n.".
    start = raw.find("ABASEMENT, n.")
    if start < 0:
        raise ValueError(f"{dictd_path} does not hold The Devil's Dictionary (no 'ABASEMENT, n.' entry)")
    entries = split_entries(raw[start:])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
    return entries


def load_entries(path: Path = CORPUS_PATH) -> list[dict]:
    """The shipped corpus: a list of ``{"headword", "pos", "text"}`` dicts in dictionary order."""
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def headword_prompts(n: int | None = None) -> list[str]:
    """Prompts like ``"CYNIC, n."`` for ``n`` entries spread evenly over the dictionary."""
    entries = load_entries()
    if n is not None:
        if not 1 <= n <= len(entries):
            raise ValueError(f"n must be between 1 and {len(entries)}, got {n}")
        step = len(entries) / n
        entries = [entries[int(i * step)] for i in range(n)]
    return [f"{e['headword']}, {e['pos']}" for e in entries]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cbteach.bierce.corpus",
                                description="Build bierce's training corpus (one entry per line) from dict-devil.")
    p.add_argument("--dictd", type=Path, default=DICTD_PATH, help="the dictd file (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("corpus.jsonl"),
                   help="where to write (default: ./corpus.jsonl; the shipped one is cbteach/bierce/corpus.jsonl)")
    a = p.parse_args(argv)
    try:
        built = build(a.dictd, a.out)
    except (OSError, ValueError) as err:
        print(f"python -m cbteach.bierce.corpus: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(built)} entries to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
