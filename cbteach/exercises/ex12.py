"""Notebook 12: your engine -- every piece you wrote, in one engine, proved, measured and served.

:func:`check_my_engine` runs ``my_engine(model, tok, **options)`` on the course workload beside the engine's own
pieces: every piece plugged in, the same schedule step for step, ``model.generate``'s tokens, every block back.
When it goes wrong, each piece's own check names the piece.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ..core.clock import VirtualClock
from ..engine.engine import Engine
from ..serving.metrics import summarize
from ..viz.schedule import first_difference
from . import fail, generated_all, guard, passed, report, self_check
from .capstone import PIECES, Pieces, check_piece, serve_options, stand_in

OPTIONS = dict(max_batch_size=4, block_size=4, num_blocks=32, token_budget=8)  # it preempts and chunks
NUM_REQUESTS, MAX_NEW_TOKENS = 10, 40


def course_requests(model, tok, n: int = NUM_REQUESTS, max_new_tokens: int = MAX_NEW_TOKENS) -> list:
    """The course's workload: bierce's headword prompts (token-id prompts for a model without
    bierce's tokenizer), answers that stop at EOS."""
    from ..core.request import Request

    if tok is not None and len(tok) >= 2048:
        from ..serving.workloads import headwords

        return headwords(tok, n=n, max_new_tokens=max_new_tokens).requests()
    span = max(1, min(model.config.vocab_size, 97) - 3)
    return [Request([3 + (13 * i + 5 * j) % span for j in range(4 + 3 * i)], max_new_tokens, request_id=f"r{i}")
            for i in range(n)]


generate_outputs = generated_all  # per-prompt greedy model.generate: the ground truth (notebook 12 calls it)


def _plugged(engine, pieces: Pieces) -> str | None:
    """What of ``pieces`` is not in ``engine`` (None: all of it)."""
    want = pieces.objects
    if engine is None:
        return "not done yet: my_engine returned None -- write it in the cell under '2. Exercise: assemble your engine'"
    if not isinstance(engine, Engine):
        return f"my_engine must return a cbteach Engine, got {type(engine).__name__}"
    if want.get("scheduler") is not None and not isinstance(engine.scheduler, want["scheduler"]):
        return "your engine does not run your scheduler: pass scheduler_cls= (the class capstone gives you)"
    if engine.kv.kind != "paged":
        return "your engine has no paged KV cache: pass kv='paged' (your KV manager, attention, slot mapping need it)"
    manager = engine.kv.manager
    if want.get("kv_manager") is not None and not isinstance(getattr(manager, "mine", manager), want["kv_manager"]):
        return "your engine does not use your KV manager: pass kv_manager= (the class, MyKVManager)"
    if want.get("attention") is not None and want.get("slot_mapping") is not None and \
            (engine.kv.attention, engine.kv.slot_mapping) == (want["slot_mapping"], want["attention"]):
        return "attention= and slot_mapping= are swapped: each takes the piece of its own name"
    for piece in ("attention", "slot_mapping"):
        got = getattr(engine.kv, piece)
        if want.get(piece) is not None and got is None:
            return f"your engine does not use your {piece.replace('_', ' ')}: pass {PIECES[piece].engine_kwarg}="
        if want.get(piece) is not None and got is not want[piece]:
            return (f"{PIECES[piece].engine_kwarg}= got another function than the piece capstone gives you (a wrapper, "
                    "a functools.partial?): pass that piece itself, so the check knows the engine runs yours")
    runner = getattr(engine.executor, "runner", None)
    if want.get("update_batch") is not None and getattr(runner, "update_batch", None) is not want["update_batch"]:
        return "your engine's worker does not run your update_batch: pass update_batch= (the function itself)"
    return None


def compare(my_engine, pieces: Pieces, model, tok=None) -> dict:
    """Run the course workload on ``my_engine(model, tok, **OPTIONS)`` and on the engine's own pieces,
    both on a step clock; what agreed (``plugged``, ``schedule``, ``tokens``, ``generate``, ``blocks``)."""
    requests = course_requests(model, tok)
    clock = VirtualClock(step_time=0.01)
    try:
        mine = my_engine(model, tok, clock=clock, **OPTIONS)
    except Exception as err:  # noqa: BLE001 -- the learner's my_engine, building its Engine
        return {"plugged": _build_hint(err)}
    out = {"plugged": _plugged(mine, pieces)}
    if out["plugged"] is None and mine.clock is not clock:
        out["plugged"] = ("your engine did not take the options the check passed (its clock, the batch size, the "
                          "token budget...): pass them on, Engine(model, tok, ..., **options)")
    if out["plugged"] is None and tok is not None and mine.tokenizer is not tok:
        out["plugged"] = ("your engine was built without the tokenizer my_engine was given, so its answers have no "
                          "text and it cannot stop on a stop string: pass it on, Engine(model, tok, ...)")
    if out["plugged"] is not None:
        return out
    written = {piece: obj for piece, obj in pieces.objects.items() if obj is not None}
    both = {"scheduler": ("schedule", "update_from_output")}  # the assembled engine runs your update too
    refused = next((said for said in (guard.refusal(p, o, both.get(p)) for p, o in written.items()) if said), None)
    if refused:
        return {**out, "refused": refused}
    ref = Engine(model, tok, kv="paged", clock=VirtualClock(step_time=0.01), **OPTIONS)
    ref.run(course_requests(model, tok))
    try:
        mine.run(requests)
    except Exception as err:  # noqa: BLE001 -- a piece of the learner's, inside the engine
        out["error"] = f"{type(err).__name__}: {err}"
        return out
    expected, ref_records, my_records = generated_all(model, requests), ref.records, mine.records
    outputs = {rid: c.output_ids for rid, c in mine.completions.items()}
    out.update(steps=len(my_records), diverges_at=first_difference(ref_records, my_records),
               tokens=outputs == {rid: c.output_ids for rid, c in ref.completions.items()},
               generate=outputs == expected, blocks=mine.kv_usage()["num_used_blocks"] == 0,
               num_requests=len(requests), num_tokens=sum(len(t) for t in expected.values()),
               preemptions=sum(len(r.preempted) for r in my_records),
               chunks=sum(1 for r in my_records for s in r.seqs if s.kind == "prefill" and s.sampled is None))
    return out


def _build_hint(err: Exception) -> str:
    """What to say when ``my_engine(model, tok, **options)`` raised before it returned an engine."""
    said = f"{type(err).__name__}: {err}"
    if isinstance(err, TypeError) and "multiple values for keyword argument" in str(err):
        return (f"my_engine(model, tok, **options) raised {said} -- you set it yourself and the options the check "
                "passes set it too: leave it to the options")
    if isinstance(err, TypeError) and "__init__() missing" in str(err) and "Scheduler" in str(err):
        return (f"my_engine(model, tok, **options) raised {said} -- scheduler_cls takes the class itself: the engine "
                "builds the scheduler, with its config and KV manager")
    if isinstance(err, TypeError) and ("keyword" in str(err) or "argument" in str(err)):
        return (f"my_engine(model, tok, **options) raised {said} -- the check calls it with options (a clock, "
                "the batch size, the token budget): pass them on, Engine(model, tok, ..., **options)")
    return f"my_engine(model, tok, **options) raised {said}"


def _blame(pieces: Pieces, model, tok) -> tuple[str | None, str]:
    """Run each piece's own check: the first one that fails, with its hint (None: every piece passes)."""
    for piece in PIECES:  # in the notebooks' order
        obj = pieces.objects.get(piece)
        if obj is None or piece in pieces.course:  # the course's passes its check
            continue
        ok, said = check_piece(piece, obj, model, tok, slot_mapping=pieces.objects.get("slot_mapping"))
        if not ok:
            return piece, said
    return None, "every piece passes its own check, so look at how they are put together in my_engine"


_last: list = []  # the last check's (arguments, answer): the notebook's later cells ask again, and get it at once


def check_my_engine(my_engine, pieces, model, tok=None) -> bool:
    """``my_engine(model, tok, **options)`` -> an Engine with every piece of ``pieces`` plugged in; see the
    module. Asked again about the same objects, it repeats its answer without running everything again."""
    key = (my_engine, pieces, model, tok)
    if _last and all(a is b for a, b in zip(_last[0], key)):
        return report(_last[1], _last[2], _last[2])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = _check_my_engine(my_engine, pieces, model, tok)
    printed = out.getvalue()
    mark = "\n" + ("✓ " if ok else "✗ ")  # the verdict is the check's last print; before it, my_engine's own
    cut = ("\n" + printed).rfind(mark)  # (where the verdict's mark starts in printed)
    print(printed[:max(cut, 0)], end="")  # what my_engine printed, as it printed it
    text = printed[cut + 2:].strip() if cut >= 0 else printed.strip()
    _last[:] = [key, ok, text]
    return report(ok, text, text)


@self_check
def _check_my_engine(my_engine, pieces, model, tok=None) -> bool:
    if my_engine is None or my_engine is Ellipsis or not callable(my_engine):
        return fail("not done yet: write my_engine(model, tok, **options), returning an Engine with your "
                    "pieces plugged in")
    if not isinstance(pieces, Pieces):
        return fail("pass the pieces capstone.pieces_from_notebooks() found")
    missing = [p for p, o in pieces.objects.items() if o is None]
    lost = sorted({PIECES[p].notebook for p in missing if pieces.where.get(PIECES[p].notebook, "") is None})
    if lost:
        return fail(f"not done yet: notebook {' and '.join(lost)} was not found, so its pieces count as "
                    "not written -- bring it beside this notebook (on Colab: upload it, or mount Drive) "
                    "and run the cell that reads your pieces again; its lines say where it looked")
    if missing:
        return fail(f"not done yet: no {', '.join(missing)} in notebooks "
                    f"{' and '.join(sorted({PIECES[p].notebook for p in missing}))} -- write them there, save, "
                    "and run the cell that reads your pieces again")
    stood = {}  # catch-up: a piece of yours that fails its own check -> what it said (the course's stands in)
    while True:
        got = compare(my_engine, pieces, model, tok)
        if got["plugged"] is not None or "refused" in got:
            return fail(got["plugged"] or got["refused"])
        if "error" in got:
            what = f"your engine stopped: {got['error']}"
        elif not (got["generate"] and got["tokens"] and got["blocks"] and got["diverges_at"] is None):
            what = "your engine ran the course workload, but " + (
                "its tokens differ from model.generate's" if not got["generate"] else
                "KV blocks were left in use" if not got["blocks"] else
                f"its schedule parts from the engine's at step {got['diverges_at']}")
        else:  # served exactly; each piece on its own check too (late arrivals, prefix hits, stop ids, guesses:
            what = "your engine served the course workload exactly"  # rules the course workload never tries)
        piece, said = _blame(pieces, model, tok)
        if piece is None and what.endswith("exactly"):
            break
        if piece is None or piece in stood or not stand_in(pieces, {piece: said}) or piece not in pieces.course:
            if piece is not None:
                said = (f"your {piece.replace('_', ' ')} (notebook {PIECES[piece].notebook}) fails its own check: "
                        f"{said}. To go on meanwhile with the course's {piece} (marked as the course's): "
                        f"capstone.pieces_from_notebooks(use_course_for=[\"{piece}\"])")
            return fail(f"{what}{', but' if what.endswith('exactly') else '.'} {said}")
        stood[piece] = said
    course = [p for p in PIECES if p in pieces.course]
    whose = ("your engine -- your KV manager, slot mapping, attention, scheduler, update and batch update --"
             if not course else f"the engine of these pieces -- yours: {', '.join(pieces.yours) or 'none'}; "
             f"NOT YOURS: the course's own solution for {', '.join(course)} --")
    stood_in = "".join(f"; the course's {p} stood in for yours, which fails its own check ({said})"
                       for p, said in stood.items())
    return passed(f"{whose} served {got['num_requests']} requests ({got['num_tokens']} tokens, {got['preemptions']} "
                  f"preemptions, {got['chunks']} prefill chunks) step for step as the engine's own pieces do, every "
                  f"token equal to model.generate's, every KV block back{stood_in}")


def side_by_side(my_engine, model, tok=None) -> tuple:
    """Your engine and the engine's own pieces after the course workload, on the same step clock."""
    mine = my_engine(model, tok, clock=VirtualClock(step_time=0.01), **OPTIONS)
    own = Engine(model, tok, kv="paged", clock=VirtualClock(step_time=0.01), **OPTIONS)
    for engine in (mine, own):
        engine.run(course_requests(model, tok))
    return mine, own


def serve_my_engine(module_path, *server_args):
    """``serve`` with every piece of the module at ``module_path``, its folder importable; the started server."""
    from ..serving.server import ServerThread

    importable(Path(module_path).parent)
    return ServerThread(["--port", "0", *server_args, *serve_options(Path(module_path).stem)]).start()


def importable(folder) -> None:
    """Let this process and those it starts import from ``folder``, as ``python -m cbteach serve`` there does."""
    folder = str(Path(folder).resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])


METRICS = ("tokens_per_s", "ttft_p50", "tpot_p50")  # what benchmark() summarises


def benchmark(my_engine, model, tok=None, rounds: int = 3) -> dict:
    """Your engine's and the engine's own :data:`METRICS` on the course workload, wall time: ``{"median", "min",
    "max"}`` over ``rounds`` interleaved rounds after a warm-up (the order flipped each round, so a slow spell falls
    on both), and ``"runs"``: every round's :func:`~cbteach.serving.metrics.summarize`."""
    import statistics

    if not (isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1):
        raise ValueError(f"rounds must be a whole number >= 1, got {rounds!r}")
    builds = {"your engine": lambda: my_engine(model, tok, **OPTIONS),
              "the engine's own pieces": lambda: Engine(model, tok, kv="paged", **OPTIONS)}
    runs = {name: [] for name in builds}
    for i in range(-1, rounds):  # round -1: the warm-up (one-off costs)
        for name in (list(builds) if i % 2 == 0 else list(builds)[::-1]):
            done = builds[name]().run(course_requests(model, tok))
            if i >= 0:
                runs[name].append(summarize(done))

    def spread(values):
        return dict(median=statistics.median(values), min=min(values), max=max(values)) if values else None

    return {name: {"runs": got, **{key: spread([s[key] for s in got if s[key] is not None]) for key in METRICS}}
            for name, got in runs.items()}


def submit(url: str, source: str, name: str, api_key: str, timeout: float = 300.0) -> dict:
    """Send a scheduler file's text to a workshop's tournament server; its entry (goodput and rank, or why not)."""
    body = json.dumps({"name": name, "source": source}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/submit", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())["entry"]
    except urllib.error.HTTPError as err:
        detail = json.loads(err.read() or b"{}").get("detail", err.reason)
        raise ValueError(f"the tournament refused the submission ({err.code}): {detail}") from None
