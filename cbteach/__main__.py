"""Command line: ``python -m cbteach {demo,mask,bench,student}``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m cbteach", description="cbteach: continuous batching, taught")
    parser.add_argument("command", choices=["demo", "mask", "bench", "student"], help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        p = argparse.ArgumentParser(prog="python -m cbteach demo")
        p.add_argument("--model", default="bierce", help="'bierce' (embedded, offline) or a hub id such as gpt2")
        p.add_argument("--batch-size", type=int, default=3)
        p.add_argument("--max-new-tokens", type=int, default=160)
        a = p.parse_args(rest)
        from .demo import run_demo

        return 0 if run_demo(a.model, a.batch_size, a.max_new_tokens) else 1
    if command == "mask":
        from .viz.mask import cli

        return cli(rest) or 0
    if command == "bench":
        from .bench import cli

        return cli(rest) or 0
    if command == "student":
        from .student import cli

        return cli(rest) or 0
    parser.error(f"unknown command {command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
