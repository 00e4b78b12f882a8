"""Helpers shared by the server's tests: the reference answers, /metrics reads, bounded waits, a served process.

Every wait here is bounded and fails saying what it waited for; every process started is killed in a
``finally`` by whoever started it (:class:`Served` is a context manager).
"""
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

WAIT_S = 30
LAB = 'model_name="bierce"'


def make_ref(model, tok):
    """Greedy per-prompt ``generate``: ``ref(prompt ids or text, n) -> output ids``, cached."""
    cache = {}

    def run(prompt, n):
        ids = tuple(tok(prompt)["input_ids"]) if isinstance(prompt, str) else tuple(prompt)
        if (ids, n) not in cache:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                 eos_token_id=model.generation_config.eos_token_id,
                                 pad_token_id=model.generation_config.eos_token_id)
            cache[(ids, n)] = out[0, len(ids):].tolist()
        return cache[(ids, n)]

    run.tok = tok
    run.text = lambda ids: tok.decode(ids, skip_special_tokens=True)
    return run


def parse_metrics(text: str) -> dict:
    from cbteach.serving.server_metrics import parse

    return parse(text)


def metrics(url, key=None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return parse_metrics(httpx.get(url + "/metrics", headers=headers, timeout=WAIT_S).text)


def core_sum(m: dict, name: str) -> float:
    """A per-core metric summed over the engine cores."""
    return sum(v for k, v in m.items() if k.startswith(f"cbteach:{name}{{{LAB},engine="))


def success(m, reason) -> float:
    return m[f'cbteach:request_success_total{{{LAB},finished_reason="{reason}"}}']


def failure(m, reason) -> float:
    return m[f'cbteach:request_failure_total{{{LAB},reason="{reason}"}}']


def wait_idle(url, key=None) -> dict:
    """Poll /metrics until nothing runs or waits on any core and every KV block is free (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        m = metrics(url, key)
        if core_sum(m, "num_requests_running") == 0 and core_sum(m, "num_requests_waiting") == 0 and \
                core_sum(m, "kv_cache_usage_perc") == 0 and core_sum(m, "engine_load_tokens") == 0:
            return m
        time.sleep(0.05)
    pytest.fail(f"the server did not become idle with every block free within {WAIT_S} s: {m}")


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent counts as exited)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(cond, what: str, timeout: float = WAIT_S, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"still waiting for {what} after {timeout} s")


class Served:
    """``python -m cbteach serve --port 0 ARGS`` in a subprocess, as a user starts it: ``url`` from what it
    prints, ``stop()`` by SIGTERM, killed (with its engine cores) in ``__exit__`` whatever happened."""

    def __init__(self, args, log_path, timeout: float = 120.0):
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cbteach", "serve", "--port", "0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.timeout = timeout
        self.url = None

    def __enter__(self):
        try:
            deadline = time.monotonic() + self.timeout
            while self.url is None:
                found = re.search(r"serving \S+ on (http://\S+) ", self.text())
                if found:
                    self.url = found.group(1)
                elif self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the server did not announce itself:\n{self.text()[-3000:]}")
                else:
                    time.sleep(0.1)
        except BaseException:
            self.kill()
            raise
        return self

    def text(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def core_pids(self) -> list:
        """The engine cores' process ids: the server's children running cbteach.serving.engine_core."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [c.pid for c in children if "cbteach.serving.engine_core" in " ".join(c.cmdline())]

    def stop(self, timeout: float = WAIT_S) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        pids = self.core_pids() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in pids:  # cores exit by themselves when their server is gone; this is the belt and braces
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()

    def __exit__(self, *exc):
        self.kill()
