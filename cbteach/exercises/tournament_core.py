"""The scheduler tournament itself: one trace, every entrant in the real engine, the rules, the ranking.

Entrants run on the same :class:`Trace` on a simulated clock, so every machine gets the same result. The
policy is free; the safety rules (:mod:`.rules`), every block back and every token ``model.generate``'s are
not: a rule-breaker is disqualified with the rule's hint, the rest ranked by goodput (requests per simulated
second meeting the TTFT and TPOT targets). The engine's own scheduler is the baseline.
"""
from __future__ import annotations

import random
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

from ..core.clock import VirtualClock
from ..core.request import Request
from ..engine.engine import Engine
from ..engine.scheduler import Scheduler
from ..serving.metrics import summarize
from . import generated_all, guard
from .scheduler_check import leftovers, run, watched

BASELINE = "the engine's own (vLLM V1)"


@dataclass(frozen=True)
class Trace:
    """The workload every entrant runs: ``num_requests`` Poisson arrivals at ``rate`` per simulated
    second; a ``long_share`` of the prompts long. Outputs have fixed lengths (``ignore_eos``), so the
    load is the trace's, not the model's. A step costs ``step_overhead + per_token * tokens`` seconds."""

    num_requests: int = 24
    rate: float = 10.0
    seed: int = 0
    short_prompt: tuple = (4, 24)
    long_prompt: tuple = (60, 140)
    long_share: float = 0.3
    output: tuple = (8, 40)
    max_batch_size: int = 6
    token_budget: int = 64
    block_size: int = 8
    num_blocks: int = 48
    step_overhead: float = 0.01
    per_token: float = 0.0005
    ttft_slo: float = 0.5
    tpot_slo: float = 0.03
    time_limit: float = 300.0  # wall seconds an entrant may take for the whole trace (an endless loop is then out)

    def requests(self, vocab_size: int) -> list[Request]:
        rng = random.Random(self.seed)
        span = max(1, min(vocab_size, 97) - 3)
        t, out = 0.0, []
        for i in range(self.num_requests):
            t += rng.expovariate(self.rate)
            lo, hi = self.long_prompt if rng.random() < self.long_share else self.short_prompt
            n = rng.randint(lo, hi)
            prompt = [3 + rng.randrange(span) for _ in range(n)]
            out.append(Request(prompt, rng.randint(*self.output), request_id=f"r{i:02d}", arrival_time=round(t, 4),
                               ignore_eos=True))
        return out

    def step_time(self, plan) -> float:
        return self.step_overhead + self.per_token * plan.total_num_scheduled_tokens

    def engine(self, model, scheduler_cls=None) -> Engine:
        return Engine(model, None, max_batch_size=self.max_batch_size, kv="paged", block_size=self.block_size,
                      num_blocks=self.num_blocks, token_budget=self.token_budget, scheduler_cls=scheduler_cls,
                      clock=VirtualClock(step_time=self.step_time))


@dataclass
class Entry:
    """One entrant's result: its metrics, or why it was disqualified."""

    name: str
    disqualified: str | None = None
    goodput: float | None = None  # good requests per simulated second
    num_good: int = 0
    num_requests: int = 0
    ttft_p90: float | None = None
    tpot_p90: float | None = None
    ttft_mean: float | None = None
    duration: float | None = None
    steps: int = 0
    preemptions: int = 0
    rank: int | None = None
    summary: dict = field(default_factory=dict, repr=False)
    course: bool = False  # the scheduler is the course's solution (a piece not written yet, or pasted): marked so

    @property
    def label(self) -> str:
        """The name as the table and the plot show it: the course's scheduler marked."""
        return f"{self.name} (the course's)" if self.course else self.name

    def short_label(self, width: int = 40) -> str:
        """:attr:`label` in ``width`` characters: a long name is cut, never the course's mark."""
        mark = " (the course's)" if self.course else ""
        name = self.name if len(self.name) + len(mark) <= width else self.name[:width - len(mark) - 1] + "…"
        return name + mark


generate_outputs = generated_all  # per-prompt greedy model.generate, EOS off (the trace ignores it)


LOAD_TIME_LIMIT = 60.0  # wall seconds a file's top level may take to run when it is loaded


def load_schedulers(folder) -> dict:
    """``{name: MyScheduler class, or the reason it cannot run}`` for every ``*.py`` file in ``folder``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: give the folder that holds the schedulers' .py files")
    files = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if not files:
        raise ValueError(f"{folder} holds no .py file: each entrant is a file that defines MyScheduler")
    return {path.stem: load_scheduler(path) for path in files}


def load_scheduler(path: Path, time_limit: float | None = None):
    """The ``MyScheduler`` class the file at ``path`` defines, or the reason it cannot run (a str). The file is
    compiled from its text each time (no bytecode cache: a fixed resubmission of the same size within the same
    second would load the old one), and its top level runs for at most ``time_limit`` wall seconds (default
    :data:`LOAD_TIME_LIMIT`)."""
    time_limit = LOAD_TIME_LIMIT if time_limit is None else time_limit
    path = Path(path)
    module = types.ModuleType(f"cbteach_tournament_{path.stem}")
    module.__file__ = str(path)
    source = path.read_text(encoding="utf-8")
    done, err = _in_time(lambda: exec(compile(source, str(path), "exec"), module.__dict__), time_limit)  # noqa: S102
    if not done:
        return f"the file did not finish loading within {time_limit:g} s of wall time (an endless loop at its top level?)"
    if err is not None:  # a learner's file: sys.exit() and KeyboardInterrupt too, which must not end the room
        return f"the file did not run: {type(err).__name__}: {err}"
    cls = getattr(module, "MyScheduler", None)
    if cls is None:
        return "the file defines no class MyScheduler"
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        return "MyScheduler is not a subclass of cbteach.engine.scheduler.Scheduler"
    if cls.schedule is Scheduler.schedule:
        return "MyScheduler does not define schedule(self, now)"
    return cls


def run_entry(name: str, cls, model, trace: Trace, expected: dict) -> Entry:
    """Run one entrant (a class, or why it cannot run) on ``trace``; ``expected``: ``model.generate``'s tokens."""
    entry = Entry(name, num_requests=trace.num_requests, course=getattr(cls, "course_solution", False) is True)
    if isinstance(cls, str):
        entry.disqualified = cls
        return entry
    if cls is not Scheduler and guard.refusal("scheduler", cls):  # (super().schedule(): the course's, marked so)
        entry.course = True
    result = _run_in_time(model, trace, cls if cls is Scheduler else watched(cls, rules_="safety"))
    if isinstance(result, str):
        entry.disqualified = result
        return entry
    entry.steps, entry.preemptions = len(result.records), sum(len(r.preempted) for r in result.records)
    entry.disqualified = str(result.mistake) if result.mistake else leftovers(result.engine, expected)
    if entry.disqualified is None:  # TTFT counts from the arrival: a scheduler may not move it
        arrivals = {r.request_id: r.arrival_time for r in trace.requests(model.config.vocab_size)}
        moved = [rid for rid, c in result.engine.completions.items()
                 if rid in arrivals and abs(c.arrival_time - arrivals[rid]) > 1e-9]
        if moved:
            entry.disqualified = (f"MyScheduler changed the arrival_time of {len(moved)} request(s) ({moved[0]} first): a "
                                  "request arrives when it arrives, and its TTFT counts from then")
    if entry.disqualified is None:
        entry.summary = summarize(result.engine.completions, ttft_target=trace.ttft_slo, tpot_target=trace.tpot_slo)
        for key in ("goodput", "num_good", "duration", "ttft_p90", "tpot_p90", "ttft_mean"):
            setattr(entry, key, entry.summary[key])
    return entry


class OutOfTime(Exception):
    """Raised inside an entrant's run that went past the trace's wall-clock limit, to end it."""


def _run_in_time(model, trace: Trace, cls):
    """:func:`~.scheduler_check.run` on a thread of its own, waited for ``trace.time_limit`` wall seconds: the
    run, or why the entrant is out. Past the limit the run is ended by an exception raised in its thread
    (CPython's ``PyThreadState_SetAsyncExc``, at the loop's next bytecode), so an endless loop neither hangs the
    tournament nor keeps spinning beside the next entrant."""
    got: list = []

    def go():
        try:
            got.append(run(model, trace, cls, 40 * trace.num_requests))
        except BaseException as err:  # noqa: BLE001 -- sys.exit() in a learner's schedule, or OutOfTime
            got.append(f"the run stopped with {type(err).__name__}: {err}")

    if not _in_time(go, trace.time_limit)[0]:
        return (f"MyScheduler did not finish the trace within {trace.time_limit:g} s of wall time (an endless loop?): "
                "a step's plan must come back")
    return got[0]


def _in_time(fn, seconds: float) -> tuple[bool, BaseException | None]:
    """``fn()`` on a thread of its own, waited for ``seconds``: ``(True, what it raised or None)``, or ``(False, None)``
    when it ran past them -- ended then by an exception raised in its thread (CPython's
    ``PyThreadState_SetAsyncExc``, at its next bytecode), so it does not keep spinning beside the next entrant."""
    import ctypes

    raised: list = [None]

    def go():
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 -- a learner's code, or OutOfTime
            raised[0] = err

    worker = threading.Thread(target=go, name="tournament entrant", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(OutOfTime))
        worker.join(10.0)
        return False, None
    return True, raised[0]


def run_tournament(entrants: dict, model, trace: Trace = Trace(), baseline: bool = True,
                   progress: bool = False) -> list[Entry]:
    """Every entrant (``{name: class or reason}``) and the engine's own scheduler, :func:`ranked`;
    ``progress``: a progress bar on stderr."""
    from tqdm.auto import tqdm

    field_ = dict(entrants)
    if baseline:
        field_[BASELINE] = Scheduler
    with tqdm(total=len(field_) + 1, desc="tournament", unit="entry", disable=not progress, leave=False) as bar:
        bar.set_postfix_str("reference outputs (generate)")
        expected = generate_outputs(model, trace.requests(model.config.vocab_size))
        bar.update()
        entries = []
        for name, cls in field_.items():
            bar.set_postfix_str(name)
            entries.append(run_entry(name, cls, model, trace, expected))
            bar.update()
    return ranked(entries)


def ranked(entries: list[Entry]) -> list[Entry]:
    """``entries`` ranked by goodput (best first; ties by mean TTFT, listed by name), the disqualified last, unranked.
    Entries equal in both share their place (1, 1, 3)."""
    def score(e):
        return -(e.goodput or 0.0), e.ttft_mean if e.ttft_mean is not None else float("inf")

    good = sorted((e for e in entries if e.disqualified is None), key=lambda e: (*score(e), e.name))
    bad = sorted((e for e in entries if e.disqualified is not None), key=lambda e: e.name)
    for i, e in enumerate(good, 1):
        e.rank = good[i - 2].rank if i > 1 and score(good[i - 2]) == score(e) else i
    for e in bad:
        e.rank = None
    return good + bad


def table(entries: list[Entry], trace: Trace) -> str:
    """The leaderboard as text."""
    head = (f"goodput: requests per simulated second meeting TTFT <= {trace.ttft_slo:g} s and TPOT <= "
            f"{trace.tpot_slo:g} s; {trace.num_requests} requests, budget {trace.token_budget}, "
            f"{trace.num_blocks} blocks of {trace.block_size}, {trace.max_batch_size} slots")
    lines = [head, f"{'rank':>4}  {'scheduler':40s} {'goodput':>8} {'met SLO':>8} {'TTFT p90':>9} {'TPOT p90':>9} "
                   f"{'steps':>6} {'preempt':>7}"]
    for e in entries:
        if e.disqualified is None:
            lines.append(f"{e.rank:>4}  {e.short_label():40s} {e.goodput:8.3f} {e.num_good:>4}/{e.num_requests:<3} "
                         f"{e.ttft_p90:8.3f}s {e.tpot_p90:8.4f}s {e.steps:>6} {e.preemptions:>7}")
        else:
            lines.append(f"{'DQ':>4}  {e.short_label():40s} disqualified: {e.disqualified}")
    return "\n".join(lines)
