"""The command line: ``python -m cbteach COMMAND [ARGS]`` (or ``cbteach COMMAND`` once installed).

Each command lives in its own module and is imported only when it runs, so ``--help`` is quick
and a command whose optional dependencies are missing (``serve`` needs ``cbteach[serve]``) says
so in one line instead of breaking the others. Errors the user can fix -- a bad option, an
unknown model while offline, a file that cannot be written -- end in one ``error:`` line and exit
status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys

# name -> what it does; the top-level --help prints this list.
COMMANDS = {
    "demo": "static vs continuous batching on six requests, told step by step in the terminal (offline)",
    "mask": "print the attention mask of one packed step, e.g. mask --cached 3,0,5 --new 1,4,1 (no model)",
    "bench": "benchmark static batching, cbteach's engines and transformers on a workload; writes JSON",
    "notebooks": "write the course notebooks into a folder, e.g. notebooks course/ (--student: with stubs)",
    "student": "copy a folder of notebooks with each exercise's solution replaced by a stub",
    "serve": "an OpenAI-compatible HTTP server on the engine (needs: pip install 'cbteach[serve]')",
    "bench-serve": "load-test a running server endpoint and report TTFT/TPOT (needs cbteach[serve])",
    "tournament": "rank a folder of learners' schedulers (notebook 06's MyScheduler) on one trace, in the real engine",
    "simulate": "the engine's scheduler at GPU and cluster scale, on a cost model (no weights; notebook 13)",
    "preflight": "is this machine ready for the workshop? versions, the model offline, a tiny engine vs generate",
}
# serve's options that plug a learner's pieces into the engine (notebook 12): checked before it starts.
PIECE_OPTIONS = ("--scheduler", "--kv-manager", "--attention", "--slot-mapping", "--update-batch")
SERVE_HINT = "pip install 'cbteach[serve]'"


def _version() -> str:
    from . import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:12s} {what}" for name, what in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="python -m cbteach", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="cbteach: continuous batching for LLM inference, taught by a real, small engine.",
        epilog=f"commands:\n{listing}\n\nRun `python -m cbteach COMMAND --help` for a command's options. "
               "Start with `python -m cbteach demo`.")
    p.add_argument("--version", action="version", version=f"cbteach {_version()}")
    p.add_argument("command", metavar="COMMAND", choices=list(COMMANDS), help="what to run (the commands below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's own options")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "--version":
        print(f"cbteach {_version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}")
    try:
        return run_command(command, rest)
    except (ValueError, OSError) as e:  # what the user asked for cannot be done: say why, no traceback
        print(f"python -m cbteach {command}: error: {e}", file=sys.stderr)
        return 2


def _demo(rest: list[str]) -> int:
    from .viz.mask_cli import positive_int

    p = argparse.ArgumentParser(prog="python -m cbteach demo", description=COMMANDS["demo"],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="bierce", help="'bierce' (embedded, offline) or a hub id such as gpt2")
    p.add_argument("--batch-size", type=positive_int, default=3, help="slots in the batch")
    p.add_argument("--max-new-tokens", type=positive_int, default=160, help="output cap of each request")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="timed runs of each strategy; the speed-up is the median")
    p.add_argument("--device", default="auto", help="auto (the best this machine has), cpu, cuda or mps")
    a = p.parse_args(rest)
    from .demo import run_demo
    from .models import device_option

    try:
        device = device_option(a.device)
    except ValueError as e:
        p.error(str(e))
    from .demo import make_requests

    most = len(make_requests(1))
    if a.batch_size > most:  # more slots than requests: static batching would pad empty rows, for show
        p.error(f"--batch-size {a.batch_size}: the demo has {most} requests, so at most {most} slots can be used")
    return 0 if run_demo(a.model, a.batch_size, a.max_new_tokens, repeat=a.repeat, device=device) else 1


def _optional(command: str, module: str, rest: list[str]) -> int:
    """``serve`` and ``bench-serve``: their module's ``main(argv)``, or one line naming the extra."""
    import importlib

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401

        entry = importlib.import_module(module).main
    except ImportError as e:
        print(f"python -m cbteach {command}: error: {e.name or e} is not installed; {SERVE_HINT}", file=sys.stderr)
        return 2
    return entry(rest) or 0


def run_command(command: str, rest: list[str]) -> int:
    if command == "demo":
        return _demo(rest)
    if command == "mask":
        from .viz.mask_cli import cli

        return cli(rest) or 0
    if command == "bench":
        from .bench.cli import cli

        return cli(rest) or 0
    if command == "serve":
        if any(a.split("=")[0] in PIECE_OPTIONS for a in rest):
            from .exercises.capstone import refuse_broken_pieces

            refuse_broken_pieces(rest)  # a piece that fails its check: ValueError with the check's hint
        return _optional(command, "cbteach.serving.server", rest)
    if command == "tournament":
        from .exercises.tournament import cli

        return cli(rest) or 0
    if command == "simulate":
        from .sim.cli import cli

        return cli(rest) or 0
    if command == "preflight":
        from .preflight import cli

        return cli(rest)
    if command == "bench-serve":
        return _optional(command, "cbteach.bench.endpoint", rest)
    from .student import cli, notebooks_cli

    return (notebooks_cli(rest) if command == "notebooks" else cli(rest)) or 0


if __name__ == "__main__":
    from .serving import server as _server

    _server.PROCESS_ENTRY = True  # serve, once stopped, ends this process without torch's slow teardown
    sys.exit(main())
