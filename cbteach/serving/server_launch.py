"""Start ``python -m cbteach serve`` as a separate process and stop it the way an operator would.

A notebook (and a test) that talks to the server should meet it as users do: a process of its own
(with its engine cores beside it), reached only over HTTP. :func:`launch` starts it with ``--port 0``
-- the system picks a free port, the server says which -- waits (bounded) until it says it is
serving and ``/health`` answers, and returns a :class:`ServerProcess`; :meth:`ServerProcess.stop`
sends SIGTERM -- in-flight requests get the drain timeout, then are aborted, the cores stop -- and
returns the exit status.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server: ``url``, ``pid``, ``log()`` (what it printed), ``stop()``."""

    def __init__(self, proc, url: str, log_path: str):
        self.proc, self.url, self.log_path = proc, url, log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait (bounded; killed if it does not exit). Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def launch(args=(), timeout: float = 120.0) -> ServerProcess:
    """``python -m cbteach.serving.server --port 0 ARGS`` in a subprocess, once it serves and ``/health`` answers."""
    log = tempfile.NamedTemporaryFile("w", prefix="cbteach-serve-", suffix=".log", delete=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "cbteach.serving.server", "--port", "0", *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, "", log.name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}:\n{server.log()[-2000:]}")
        found = re.search(r"serving \S+ on (http://\S+) ", server.log())
        if found:
            server.url = found.group(1)
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return server
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the server did not answer within {timeout} s:\n{server.log()[-2000:]}")
