"""The scheduler tournament: on a folder of one correct scheduler, a better policy and several that
break a rule, it ranks the rule-keepers by goodput and disqualifies each breaker with the hint for
its rule; the same trace gives the same table on every run; the command line writes a table, a
JSON file and a figure. Every entrant's tokens are checked against per-prompt ``model.generate``."""
import ast
import contextlib
import io
import json
from pathlib import Path

import pytest

from cbteach.exercises import tournament as T
from conftest import tiny_model

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "06_scheduling_and_latency.ipynb"
SOLUTION = next("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                if "solution" in c.get("metadata", {}).get("tags", []))
HEADER = "import math\nfrom cbteach.engine.scheduler import Scheduler, StepPlan\n\n\n"
CORRECT = HEADER + SOLUTION  # notebook 06's scheduler, as a learner's file
ARRIVED = "[s for s in self.waiting if s.arrival_time <= now]"


def notebook_12_entrant(name: str) -> str:
    """What notebook 12's tournament cell appends to the learner's scheduler for the entrant ``name``."""
    nb12 = Path(__file__).parent.parent / "notebooks" / "12_your_engine.ipynb"
    for cell in json.loads(nb12.read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or "%pip" in src:
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and f"{name}.py" in ast.unparse(node.func) and node.args \
                    and isinstance(node.args[0], ast.BinOp) and isinstance(node.args[0].right, ast.Constant):
                return node.args[0].right.value
    raise AssertionError(f"notebook 12 writes no entrant {name}.py")


def variant(old, new):
    assert old in CORRECT, old
    return CORRECT.replace(old, new)


# name -> (file source, words of the hint that disqualifies it); None: it keeps every rule
ENTRANTS = {
    "correct": (CORRECT, None),
    "shortest_first": (variant("for seq in " + ARRIVED, "for seq in sorted(" + ARRIVED + ", key=lambda s: s.num_tokens + "
                                                         "s.request.max_new_tokens)"), None),
    "over_budget": (variant("n = min(seq.num_tokens - num_cached_tokens, budget)", "n = seq.num_tokens - num_cached_tokens"),
                    "token budget"),
    "no_room": (variant("while seq in self.running and self.kv_manager.allocate_slots(seq, n) is None:", "while False:"), "without KV room"),
    "before_arrival": (variant(ARRIVED, "list(self.waiting)"), "before it arrived"),
    "past_the_batch": (variant("len(self.running) >= self.max_batch_size", "len(self.running) > self.max_batch_size"),
                       "max_batch_size"),
    "planned_twice": (variant("            plan.add(seq, n)\n            budget -= n\n        for",
                              "            plan.add(seq, n)\n            plan.add(seq, 1)\n            budget -= n\n        for"),
                      "twice"),
    "keeps_victims_blocks": (variant("budget += self.preempt(victim, plan)",
                                     "self.running.remove(victim)\n                budget += plan.remove(victim)\n"
                                     "                plan.preempted.append(victim)\n"
                                     "                self.waiting.readd_preempted(victim)"), "still holds its KV blocks"),
    "truncates_long_prompts": (variant("            cached, num_cached_tokens =",
                                       "            del seq.prompt_ids[48:]  # long prompts cut to fit\n"
                                       "            cached, num_cached_tokens ="), "differ from model.generate"),
    "forgets_update": (variant("        self.update_after_schedule(output)", "        pass"), "update_after_schedule"),
    "starves": (variant("if plan.preempted or len(", "if seq.prompt_ids[0] % 5 == 0:\n                continue\n"
                                                    "            if plan.preempted or len("), "planned nothing"),
    "raises": (variant("        plan = StepPlan()", "        plan = StepPlan()\n        {}['x']"), "KeyError"),
    "endless": (variant("            while seq in self.running and self.kv_manager.allocate_slots(seq, n) is None:",
                        "            while len(self.running) > 0:\n                pass\n"
                        "            while seq in self.running and self.kv_manager.allocate_slots(seq, n) is None:"), "did not return"),
    "no_class": ("class Other:\n    pass\n", "defines no class MyScheduler"),
    # notebook 12's own wrong entrant: disqualified by the rule it is there to show, not by a crash
    "notebook_12_plus_one": (CORRECT + "\n" + notebook_12_entrant("yours_plus_one"), "planned without KV room"),
    "syntax_error": ("def (:\n", "did not run"),
    # moving waiting requests' arrival to now made every TTFT look short: it ranked first with the same schedule
    "fresh_arrival": (CORRECT + "\n\n_Mine = MyScheduler\n\n\nclass MyScheduler(_Mine):\n    def schedule(self, now):\n"
                      "        for s in list(self.waiting):\n            if s.arrival_time <= now:\n"
                      "                s.arrival_time = now\n        return super().schedule(now)\n",
                      "changed the arrival_time"),
    # the engine's own, through super(): ranked, marked as the course's (it was ranked as the entrant's)
    "lazy": (HEADER + "class MyScheduler(Scheduler):\n    def schedule(self, now):\n        return super().schedule(now)\n",
             None),
}
TRACE = T.Trace(num_requests=16)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def room(tmp_path_factory):
    folder = tmp_path_factory.mktemp("room")
    for name, (src, _) in ENTRANTS.items():
        (folder / f"{name}.py").write_text(src)
    (folder / "_helper.py").write_text("raise SystemExit('a helper module is not an entrant')\n")
    return folder


@pytest.fixture(scope="module")
def results(room, model):
    return T.run_tournament(T.load_schedulers(room), model, TRACE)


def test_rule_keepers_are_ranked_by_goodput_and_breakers_disqualified_with_their_hint(results):
    by = {e.name: e for e in results}
    assert set(by) == set(ENTRANTS) | {T.BASELINE}  # the _helper file is no entrant
    for name, (_, words) in ENTRANTS.items():
        e = by[name]
        if words is None:
            assert e.disqualified is None and e.rank is not None, (name, e.disqualified)
        else:
            assert e.rank is None and e.disqualified and words in e.disqualified, (name, e.disqualified)
    ranked = [e for e in results if e.rank is not None]
    score = lambda e: (e.goodput, -e.ttft_mean)  # noqa: E731
    assert [e.rank for e in ranked] == [1 + sum(score(o) > score(e) for o in ranked) for e in ranked]  # ties share
    assert [e.goodput for e in ranked] == sorted((e.goodput for e in ranked), reverse=True)
    assert results[:len(ranked)] == ranked  # disqualified ones come last


def test_an_entrant_that_is_the_engines_own_scheduler_is_marked_as_the_courses(results):
    by = {e.name: e for e in results}
    assert by["lazy"].course and by["lazy"].label == "lazy (the course's)" and not by["correct"].course


def test_the_notebooks_scheduler_is_the_engines_own_and_a_better_policy_wins(results):
    by = {e.name: e for e in results}
    correct, base, sjf = by["correct"], by[T.BASELINE], by["shortest_first"]
    assert (correct.goodput, correct.steps, correct.preemptions) == (base.goodput, base.steps, base.preemptions)
    assert sjf.goodput > base.goodput  # shortest-first meets more targets on this trace
    assert 0 < base.num_good < TRACE.num_requests  # the trace is hard enough to rank on


def test_the_trace_is_deterministic_and_mixed(model):
    a, b = TRACE.requests(97), TRACE.requests(97)
    assert [(r.prompt, r.max_new_tokens, r.arrival_time) for r in a] == [(r.prompt, r.max_new_tokens, r.arrival_time)
                                                                         for r in b]
    lengths = [len(r.prompt) for r in a]
    assert min(lengths) <= TRACE.short_prompt[1] and max(lengths) >= TRACE.long_prompt[0]
    gaps = [y.arrival_time - x.arrival_time for x, y in zip(a, a[1:])]
    assert len(set(gaps)) > 5 and all(g >= 0 for g in gaps)
    once = T.run_tournament({"correct": T.load_scheduler(_write(CORRECT))}, model, TRACE, baseline=False)
    again = T.run_tournament({"correct": T.load_scheduler(_write(CORRECT))}, model, TRACE, baseline=False)
    assert T.table(once, TRACE) == T.table(again, TRACE)


def _write(src, name="entrant.py"):
    import tempfile

    path = Path(tempfile.mkdtemp()) / name
    path.write_text(src)
    return path


def test_tokens_are_checked_against_generate_without_eos(model):
    import torch

    reqs = TRACE.requests(model.config.vocab_size)[:3]
    expected = T.generate_outputs(model, reqs)
    for r in reqs:
        ids = torch.tensor([r.prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=r.max_new_tokens,
                             eos_token_id=[], pad_token_id=0)
        assert expected[r.request_id] == out[0, ids.shape[1]:].tolist()
        assert len(expected[r.request_id]) == r.max_new_tokens  # the trace's lengths are fixed


def test_the_command_line_writes_a_table_json_and_a_figure(room, tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    small = tmp_path / "small"
    small.mkdir()
    for name in ("correct", "over_budget"):
        (small / f"{name}.py").write_text(ENTRANTS[name][0])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = T.cli([str(small), "--requests", "6", "--plot", str(tmp_path / "t.png"), "--json", str(tmp_path / "t.json")])
    text = out.getvalue()
    assert rc == 0 and "goodput" in text and "DQ" in text and "token budget" in text
    rows = json.loads((tmp_path / "t.json").read_text())
    assert {r["name"] for r in rows} == {"correct", "over_budget", T.BASELINE}
    assert (tmp_path / "t.png").stat().st_size > 10_000
    err = capsys.readouterr().err
    assert "tournament" in err and "/4" in err  # the progress bar: the reference outputs, then three entrants


def test_the_command_line_refuses_what_it_cannot_run(tmp_path):
    from cbteach.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["tournament", str(tmp_path / "missing")]) == 2
        assert main(["tournament", str(tmp_path)]) == 2  # empty
        # the room is read before the trace is drawn (100,000,000 requests ran for minutes, then "no .py file")
        assert main(["tournament", str(tmp_path), "--requests", "100000"]) == 2
        with pytest.raises(SystemExit):
            main(["tournament", str(tmp_path), "--requests", "100000000"])
    assert "not a folder" in err.getvalue() and err.getvalue().count("no .py file") == 2
    assert "argument --requests: 100,000,000 is more than 100,000" in err.getvalue()


def test_the_figure_has_titles_and_labels(results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cbteach.viz.tournament import plot_tournament

    fig = plot_tournament(results, TRACE.ttft_slo, TRACE.tpot_slo)
    assert fig._suptitle.get_text()
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    plt.close("all")
    with pytest.raises(ValueError):
        plot_tournament([], 1, 1)


def test_the_instructors_server_takes_submissions_and_ranks_them(tmp_path, model):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from cbteach.exercises.tournament_server import Board, make_app

    (tmp_path / "first.py").write_text(CORRECT)
    board = Board(tmp_path, model, T.Trace(num_requests=6))
    client = TestClient(make_app(board, "room-key"))
    key = {"Authorization": "Bearer room-key"}
    assert client.post("/submit", json={"name": "x", "source": CORRECT}).status_code == 401
    assert client.post("/submit", json={"name": "x", "source": CORRECT}, headers={"Authorization": "Bearer no"}
                       ).status_code == 401
    assert client.post("/submit", json={"name": "../evil", "source": CORRECT}, headers=key).status_code == 400
    assert client.post("/submit", json={"name": "big", "source": "#" * 70_000}, headers=key).status_code == 400
    r = client.post("/submit", json={"name": "over", "source": ENTRANTS["over_budget"][0]}, headers=key)
    assert r.status_code == 200 and "token budget" in r.json()["entry"]["disqualified"]
    r = client.post("/submit", json={"name": "sjf", "source": ENTRANTS["shortest_first"][0]}, headers=key)
    assert r.status_code == 200 and r.json()["entry"]["rank"] >= 1
    names = [e["name"] for e in client.get("/leaderboard.json").json()]
    assert set(names) == {"first", "over", "sjf", T.BASELINE} and names[-1] == "over"  # disqualified last
    assert (tmp_path / "sjf.py").read_text() == ENTRANTS["shortest_first"][0]
    assert "Scheduler tournament" in client.get("/").text
    assert client.get("/plot.png").headers["content-type"] == "image/png"


def test_the_board_answers_while_a_submission_runs(tmp_path, model, monkeypatch):
    """GET /, /leaderboard.json and /plot.png waited for the lock a submission held for its whole run (a minute or
    more at a workshop): the room's screen froze whenever anyone submitted."""
    pytest.importorskip("fastapi")
    import threading

    from fastapi.testclient import TestClient

    from cbteach.exercises import tournament_server as S

    board = S.Board(tmp_path, model, T.Trace(num_requests=4))
    client = TestClient(S.make_app(board, "k"))
    running, release, real = threading.Event(), threading.Event(), S.run_entry

    def held(*args, **kwargs):  # the entrant's run, held until the board has been read
        running.set()
        release.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(S, "run_entry", held)
    submit = threading.Thread(target=board.submit, args=("late", CORRECT))
    submit.start()
    try:
        assert running.wait(120), "the submission never started"
        answered = []
        reader = threading.Thread(target=lambda: answered.append(client.get("/leaderboard.json").json()))
        reader.start()
        reader.join(120)  # (bounded: before, it waited for the whole run)
        assert answered and [e["name"] for e in answered[0]] == [T.BASELINE], "the board waited for the submission"
    finally:
        release.set()
        submit.join(300)
    assert {e["name"] for e in client.get("/leaderboard.json").json()} == {"late", T.BASELINE}


LOOPS = HEADER + "class MyScheduler(Scheduler):\n    def schedule(self, now):\n        while True:\n            pass\n"
EXITS = HEADER + "class MyScheduler(Scheduler):\n    def schedule(self, now):\n        raise SystemExit(0)\n"


def test_an_endless_loop_or_an_exit_is_disqualified_and_the_tournament_goes_on(tmp_path, model):
    """An entrant whose schedule never returned hung the tournament (and the server, for everyone); sys.exit() at
    the top of a file or in schedule ended the whole room, its table lost, with exit status 0."""
    for name, src in (("loops", LOOPS), ("exits", EXITS), ("exits_at_import", "raise SystemExit(3)\n"),
                      ("good", CORRECT)):
        (tmp_path / f"{name}.py").write_text(src)
    by = {e.name: e for e in T.run_tournament(T.load_schedulers(tmp_path), model,
                                               T.Trace(num_requests=4, time_limit=5.0))}
    assert "did not finish the trace within 5 s" in by["loops"].disqualified
    assert "SystemExit" in by["exits"].disqualified and "SystemExit: 3" in by["exits_at_import"].disqualified
    assert by["good"].rank == 1 and by[T.BASELINE].rank == 1  # (the same policy: they share the place)


def test_a_fixed_file_of_the_same_size_written_at_once_is_the_one_loaded(tmp_path, monkeypatch):
    """Loading went through Python's bytecode cache, which trusts a file's size and whole-second time: a fix of
    the same size within the second ran the old code (where bytecode is written, as an instructor's Python does)."""
    monkeypatch.setattr("sys.dont_write_bytecode", False)
    path = tmp_path / "alice.py"
    for version in (1, 2):
        path.write_text(HEADER + f"VERSION = {version}\nclass MyScheduler(Scheduler):\n    def schedule(self, now):\n"
                                 "        return super().schedule(now)\n")
        assert T.load_scheduler(path).schedule.__globals__["VERSION"] == version


def test_long_names_keep_the_courses_mark_and_the_json_says_it(tmp_path, model):
    e = T.Entry("y" * 30, goodput=1.0, num_good=1, num_requests=1, ttft_p90=0.1, tpot_p90=0.01, ttft_mean=0.1,
                course=True)
    from cbteach.exercises.tournament_core import ranked
    line = T.table(ranked([e]), T.Trace()).splitlines()[-1]
    assert "(the course's)" in line and "…" in line, line
    from cbteach.exercises.tournament_server import _row
    assert _row(e)["course"] is True


def test_the_server_refuses_names_the_room_would_not_load(tmp_path, model):
    """``"abc\\n"`` passed the name pattern (``$`` matches before a final newline) and made a file named so;
    ``_hidden`` was ranked by the server, then skipped by every later load of the room."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from cbteach.exercises.tournament_server import Board, make_app

    client = TestClient(make_app(Board(tmp_path, model, T.Trace(num_requests=4)), "k"))
    for name in ("abc\n", "_hidden"):
        r = client.post("/submit", json={"name": name, "source": CORRECT}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 400 and "not starting with '_'" in r.json()["detail"], r.text
    assert not list(tmp_path.glob("*.py"))


def test_serving_the_tournament_needs_the_rooms_key(tmp_path, monkeypatch, model):
    from cbteach.exercises.tournament_server import serve

    monkeypatch.delenv("CBTEACH_API_KEY", raising=False)
    with pytest.raises(ValueError, match="CBTEACH_API_KEY"):
        serve(tmp_path, model, T.Trace(num_requests=4))


def test_a_learner_submits_from_the_notebook_over_http(tmp_path, model):
    pytest.importorskip("fastapi")
    import threading
    import time

    import uvicorn

    from cbteach.exercises import ex12
    from cbteach.exercises.tournament_server import Board, make_app
    from cbteach.serving.server_launch import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(Board(tmp_path, model, T.Trace(num_requests=6)), "k"),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):  # bounded: 10 s
            if server.started:
                break
            time.sleep(0.05)
        entry = ex12.submit(f"http://127.0.0.1:{port}", CORRECT, "alice", "k")
        assert entry["name"] == "alice" and entry["rank"] in (1, 2) and entry["disqualified"] is None
        with pytest.raises(ValueError, match="refused the submission \\(401\\)"):
            ex12.submit(f"http://127.0.0.1:{port}", CORRECT, "bob", "wrong key")
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_scheduler_cannot_escape_the_rules_by_changing_its_limits(model):
    src = variant("        plan = StepPlan()", "        self.token_budget = None  # no budget for me\n"
                  "        plan = StepPlan()")
    entry = T.run_tournament({"cheat": T.load_scheduler(_write(src))}, model, TRACE, baseline=False)[0]
    assert entry.disqualified and "token budget" in entry.disqualified


def test_the_server_checks_the_key_before_it_reads_a_body_and_caps_the_body(tmp_path, model, monkeypatch):
    """The body was parsed (any size, as JSON) before the key was looked at: anyone on the room's network could
    make the instructor's machine read and hold a body of any size."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from cbteach.exercises import tournament_server as S

    client = TestClient(S.make_app(S.Board(tmp_path, model, T.Trace(num_requests=4)), "k"))
    read = []
    monkeypatch.setattr(S.json, "loads", lambda body, _loads=json.loads: read.append(len(body)) or _loads(body))
    assert client.post("/submit", content=b"{" * 500_000).status_code == 401
    assert client.post("/submit", content=b"not json", headers={"Authorization": "Bearer no"}).status_code == 401
    assert read == []  # neither body was parsed
    key = {"Authorization": "Bearer k"}
    assert client.post("/submit", content=b" " * 500_000, headers=key).status_code == 413
    escaped = json.dumps({"name": "escaped", "source": CORRECT + "#" + "\x01" * (60_000 - len(CORRECT))})
    assert len(escaped) > 300_000 and client.post("/submit", content=escaped, headers=key).status_code == 200
    for body in (b"not json", b"[1, 2]"):
        r = client.post("/submit", content=body, headers=key)
        assert r.status_code == 400, r.text
    r = client.post("/submit", json={"name": "ok", "source": CORRECT}, headers=key)
    assert r.status_code == 200 and r.json()["entry"]["name"] == "ok"


def test_serve_refuses_options_it_would_ignore_and_a_busy_port_before_running_anyone(tmp_path, model, monkeypatch):
    """``--json``, ``--plot`` and ``--no-progress`` were silently ignored with ``--serve``; a busy port was found only
    after every entrant in the folder had run."""
    import socket

    from cbteach.exercises import tournament_server as S

    for flag in (["--json", str(tmp_path / "r.json")], ["--plot", str(tmp_path / "p.png")], ["--no-progress"]):
        with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(io.StringIO()) as err:
            T.cli([str(tmp_path), "--serve", *flag])
        assert exit_.value.code == 2 and "not with --serve" in err.getvalue()
    monkeypatch.setenv("CBTEACH_API_KEY", "k")
    monkeypatch.setattr(S, "Board", lambda *a, **k: pytest.fail("the board was computed before the port was tried"))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        with pytest.raises(ValueError, match="cannot listen there"):
            S.serve(tmp_path, model, T.Trace(num_requests=4), port=busy.getsockname()[1])


def test_a_file_that_never_finishes_loading_is_disqualified_and_the_room_goes_on(tmp_path, model):
    """A top-level ``while True: pass`` hung the room at load -- and the submission server for good, the file staying
    in its folder -- where only ``schedule`` had a time limit. ``KeyboardInterrupt`` at import ended the room."""
    (tmp_path / "loopy.py").write_text("while True:\n    pass\n")
    (tmp_path / "interrupts.py").write_text("raise KeyboardInterrupt\n")
    (tmp_path / "good.py").write_text(CORRECT)
    assert "did not finish loading within 2 s" in T.load_scheduler(tmp_path / "loopy.py", time_limit=2.0)
    assert "KeyboardInterrupt" in T.load_scheduler(tmp_path / "interrupts.py")
    from cbteach.exercises import tournament_core

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tournament_core, "LOAD_TIME_LIMIT", 2.0)
        loaded = T.load_schedulers(tmp_path)
    assert isinstance(loaded["loopy"], str) and isinstance(loaded["interrupts"], str)
    by = {e.name: e for e in T.run_tournament(loaded, model, T.Trace(num_requests=4))}
    assert "did not finish loading" in by["loopy"].disqualified and by["good"].rank == 1


def test_a_rate_that_spreads_the_trace_past_any_clock_and_a_port_without_serve_are_argument_errors(tmp_path):
    """--rate 1e-300 disqualified every entrant and the baseline ("looks like an absolute clock time") and exited 0;
    --host and --port without --serve were ignored."""
    (tmp_path / "good.py").write_text(CORRECT)
    for argv, words in ((["--rate", "1e-300"], "give a larger rate"), (["--port", "9000"], "only with --serve"),
                        (["--host", "0.0.0.0"], "only with --serve")):
        with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(io.StringIO()) as err:
            T.cli([str(tmp_path), *argv, "--requests", "4", "--no-progress"])
        assert exit_.value.code == 2 and words in err.getvalue(), err.getvalue()
