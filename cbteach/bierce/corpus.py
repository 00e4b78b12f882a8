"""The Devil's Dictionary as a training corpus: one dictionary entry per document.

Ambrose Bierce's *The Devil's Dictionary* (1911, public domain) is a good toy corpus for a
course on batching because its entries vary wildly in length: "CYNIC, n." gets one line,
"EXECUTIVE, n." gets a page of dialogue. A model trained on one entry per document, with an
end-of-text token after each, learns to stop by itself -- and so produces exactly the skewed
output lengths that continuous batching exploits.

The cleaned corpus ships with the package (``corpus.jsonl``), so nothing here needs the network.
``python -m cbteach.bierce.corpus`` rebuilds it from the Debian package ``dict-devil``
(``apt-get install dict-devil``), which carries the text in dictd format.
"""
from __future__ import annotations

import gzip
import json
import re
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
        body = "\n".join(l.rstrip() for l in lines).strip()
        match = _HEADWORD.match(body)
        out.append({"headword": match.group(1), "pos": match.group(2), "text": body})
    return out


def build(dictd_path: Path = DICTD_PATH, out_path: Path = CORPUS_PATH) -> list[dict]:
    """Rebuild ``corpus.jsonl`` from the dictd file of the Debian package ``dict-devil``."""
    if not dictd_path.exists():
        raise FileNotFoundError(f"{dictd_path} not found: install it with `apt-get install dict-devil`")
    raw = gzip.decompress(dictd_path.read_bytes()).decode("latin-1")
    # Skip the dictd header and the preface: the dictionary proper starts at "ABASEMENT, n.".
    start = raw.index("ABASEMENT, n.")
    entries = split_entries(raw[start:])
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


if __name__ == "__main__":
    built = build()
    print(f"wrote {len(built)} entries to {CORPUS_PATH}")
