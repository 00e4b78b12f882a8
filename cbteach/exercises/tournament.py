"""The scheduler tournament: ``python -m cbteach tournament DIR`` ranks a room's schedulers.

Every ``*.py`` file in ``DIR`` defines ``MyScheduler``; each runs on the same trace on a simulated clock
(:mod:`.tournament_core`), rule-breakers are disqualified, the rest ranked by goodput. ``--serve`` takes
submissions over HTTP (:mod:`.tournament_server`).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ..argtypes import POSITIVE, POSITIVE_INT, at_most
from ..core.validation import ABSOLUTE_TIME
from .tournament_core import (BASELINE, Entry, Trace, generate_outputs, load_scheduler, load_schedulers,  # noqa: F401
                              run_entry, run_tournament, table)


MAX_REQUESTS = 100_000  # a trace's requests: a room of schedulers each serves all of them


def cli(argv=None) -> int:
    """``python -m cbteach tournament DIR [--serve]``."""
    p = argparse.ArgumentParser(prog="python -m cbteach tournament", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("dir", type=Path, help="folder of schedulers: each *.py file defines MyScheduler")
    p.add_argument("--model", default="bierce", help="'bierce' (embedded, offline) or a hub id")
    p.add_argument("--requests", type=at_most(POSITIVE_INT, MAX_REQUESTS), default=Trace.num_requests,
                   help="requests in the trace")
    p.add_argument("--rate", type=POSITIVE, default=Trace.rate, help="arrivals per simulated second (Poisson)")
    p.add_argument("--seed", type=int, default=Trace.seed, help="the trace's random seed")
    p.add_argument("--ttft-slo", type=POSITIVE, default=Trace.ttft_slo, help="TTFT target, simulated seconds")
    p.add_argument("--tpot-slo", type=POSITIVE, default=Trace.tpot_slo, help="TPOT target, simulated seconds")
    p.add_argument("--plot", type=Path, default=None, help="save the leaderboard's figure here (PNG)")
    p.add_argument("--json", type=Path, default=None, help="save the results here")
    p.add_argument("--serve", action="store_true", help="take submissions over HTTP into DIR (the instructor's "
                                                        "variant; needs cbteach[serve] and CBTEACH_API_KEY)")
    p.add_argument("--host", default="127.0.0.1", help="with --serve: the address to listen on")
    p.add_argument("--port", type=int, default=8100, help="with --serve: the port (0..65535)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if not 0 <= a.port <= 65535:
        p.error(f"argument --port: expected a port number in 0..65535, got {a.port}")
    unused = [o for o, v in (("--json", a.json), ("--plot", a.plot), ("--no-progress", a.no_progress)) if v]
    if a.serve and unused:
        p.error(f"{', '.join(unused)}: not with --serve (the server shows its board at /, /leaderboard.json, /plot.png)")
    where = [o for o, v, default in (("--host", a.host, "127.0.0.1"), ("--port", a.port, 8100)) if v != default]
    if where and not a.serve:
        p.error(f"{', '.join(where)}: only with --serve (without it the room is ranked here, no server is started)")
    from ..argtypes import unwritable

    for option, path in (("--json", a.json), ("--plot", a.plot)):
        problem = path is not None and unwritable(path)
        if problem:  # found now, not after the whole tournament has run
            raise ValueError(f"{option} {path}: {problem}")
    schedulers = None if a.serve else load_schedulers(a.dir)  # (the room is read before the trace is drawn)
    from ..models import load_model

    model = load_model(a.model)[0]
    trace = Trace(num_requests=a.requests, rate=a.rate, seed=a.seed, ttft_slo=a.ttft_slo, tpot_slo=a.tpot_slo)
    last = trace.requests(model.config.vocab_size)[-1].arrival_time
    if last >= ABSOLUTE_TIME:  # (the engine would refuse every request, the baseline's too)
        p.error(f"argument --rate: at {a.rate:g} a second the trace's arrivals span {last:.3g} simulated seconds: "
                "give a larger rate")
    if a.serve:
        from .tournament_server import serve

        return serve(a.dir, model, trace, host=a.host, port=a.port)
    entries = run_tournament(schedulers, model, trace, progress=not a.no_progress)
    print(table(entries, trace))
    if a.json is not None:
        a.json.write_text(json.dumps([{k: v for k, v in asdict(e).items() if k != "summary"} for e in entries],
                                     indent=1))
    if a.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        from ..viz.tournament import plot_tournament

        plot_tournament(entries, trace.ttft_slo, trace.tpot_slo).savefig(a.plot, dpi=110, bbox_inches="tight",
                                                                         format="png")
        print(f"figure saved to {a.plot} (PNG)")
    sys.stdout.flush()
    return 0
