"""The tournament over a workshop's network: ``POST /submit`` (``{"name", "source"}``, with
``Authorization: Bearer <CBTEACH_API_KEY>``) saves and runs a scheduler at once; ``GET /`` shows the board
(also ``/leaderboard.json``, ``/plot.png``). Submissions are code run on the instructor's machine: the key is
always required, names are plain, sources capped; use it on a network you trust.
"""
from __future__ import annotations

import hashlib
import html
import io
import json
import os
import re
import secrets
import socket
import threading
from pathlib import Path

from ..engine.scheduler import Scheduler
from .tournament_core import BASELINE, Trace, generate_outputs, load_scheduler, ranked, run_entry, table

NAME = re.compile(r"[A-Za-z0-9-][A-Za-z0-9_-]{0,39}")  # (fullmatch; a leading '_' marks a file the room skips)
MAX_SOURCE = 64 * 1024


class Board:
    """The entrants' results, kept per (name, source) so a resubmission reruns only that entrant."""

    def __init__(self, folder: Path, model, trace: Trace):
        self.folder, self.model, self.trace = Path(folder), model, trace
        self.lock = threading.Lock()  # guards results: held for moments, so the board stays readable
        self.run_lock = threading.Lock()  # one submission saved and run at a time
        self.expected = generate_outputs(model, trace.requests(model.config.vocab_size))
        self.results: dict[str, tuple[str, object]] = {}  # name -> (source hash, Entry)
        self.baseline = run_entry(BASELINE, Scheduler, model, trace, self.expected)
        for path in sorted(self.folder.glob("*.py")):
            if not path.name.startswith("_"):
                self._run(path.stem, path.read_text(encoding="utf-8"))

    def _run(self, name: str, source: str):
        digest = hashlib.sha256(source.encode()).hexdigest()
        with self.lock:
            known = self.results.get(name)
        if known is not None and known[0] == digest:
            return known[1]
        entry = run_entry(name, load_scheduler(self.folder / f"{name}.py"), self.model, self.trace, self.expected)
        with self.lock:
            self.results[name] = (digest, entry)
        return entry

    def submit(self, name: str, source: str):
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError("name must be 1-40 letters, digits, '-' or '_', not starting with '_' (the room skips "
                             "such files)")
        if not isinstance(source, str) or not source.strip() or len(source.encode()) > MAX_SOURCE:
            raise ValueError(f"source must be the text of a .py file defining MyScheduler, at most {MAX_SOURCE} bytes")
        with self.run_lock:  # (the board is read meanwhile: GET waits for no entrant)
            (self.folder / f"{name}.py").write_text(source, encoding="utf-8")
            entry = self._run(name, source)
            return entry, self.entries()

    def entries(self) -> list:
        """Every entrant and the baseline, ranked (ranks are given afresh each time)."""
        with self.lock:
            return ranked([e for _, e in self.results.values()] + [self.baseline])


def _row(e) -> dict:
    keys = ("name", "rank", "disqualified", "goodput", "num_good", "num_requests", "ttft_p90", "tpot_p90", "steps",
            "preemptions", "course")
    return {k: getattr(e, k) for k in keys}


def make_app(board: Board, api_key: str):
    """The FastAPI app around ``board``; ``POST /submit`` needs ``api_key``."""
    from fastapi import FastAPI, HTTPException, Response
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import HTMLResponse, JSONResponse

    app = FastAPI(title="cbteach scheduler tournament")

    async def submit(request):  # (a plain route: the key is checked before the body is read)
        authorization = request.headers.get("authorization")
        if authorization is None or not secrets.compare_digest(authorization, f"Bearer {api_key}"):
            raise HTTPException(status_code=401, detail="a submission needs Authorization: Bearer <the room's key>")
        body = b""  # read only after the key, and only so much: a source is at most MAX_SOURCE bytes
        async for chunk in request.stream():
            body += chunk
            if len(body) > 6 * MAX_SOURCE + 1024:  # (JSON may escape a byte of the source as \u0001)
                raise HTTPException(status_code=413, detail=f"a submission is at most {MAX_SOURCE} bytes of source")
        try:
            fields = json.loads(body)
            if not isinstance(fields, dict):
                raise ValueError('the body must be a JSON object {"name": ..., "source": ...}')
            entry, entries = await run_in_threadpool(board.submit, fields.get("name"), fields.get("source"))
        except ValueError as err:  # (json's errors are ValueErrors too)
            raise HTTPException(status_code=400, detail=str(err)) from None
        return JSONResponse({"entry": _row(entry), "leaderboard": [_row(e) for e in entries]})

    app.add_route("/submit", submit, methods=["POST"])

    @app.get("/leaderboard.json")
    def leaderboard():
        return [_row(e) for e in board.entries()]

    @app.get("/plot.png")
    def plot():
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from ..viz.tournament import plot_tournament

        fig = plot_tournament(board.entries(), board.trace.ttft_slo, board.trace.tpot_slo)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        return Response(buf.getvalue(), media_type="image/png")

    @app.get("/", response_class=HTMLResponse)
    def page():
        text = table(board.entries(), board.trace)
        return ("<!doctype html><meta charset=utf-8><meta http-equiv=refresh content=10>"
                "<title>cbteach tournament</title><h1>Scheduler tournament</h1>"
                f"<pre>{html.escape(text)}</pre><img src='/plot.png' alt='leaderboard figure' style='max-width:100%'>")

    return app


def serve(folder, model, trace: Trace, host: str = "127.0.0.1", port: int = 8100) -> int:
    """Run the submission server until Ctrl-C (``python -m cbteach tournament DIR --serve``)."""
    api_key = os.environ.get("CBTEACH_API_KEY")
    if not api_key:
        raise ValueError("--serve runs the Python files learners submit: set CBTEACH_API_KEY to the room's key "
                         "(learners pass it to ex12.submit) and use it only on a network you trust")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:  # found now, not after every entrant in the folder has run
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as err:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err}); "
                         "choose another port") from None
    import uvicorn

    board = Board(folder, model, trace)
    print(f"tournament: {len(board.results)} entrant(s) in {folder}; submissions at http://{host}:{port}/submit, "
          f"the board at http://{host}:{port}/")
    uvicorn.run(make_app(board, api_key), host=host, port=port, log_level="warning")
    return 0
