"""Signals at every moment of a server's life, and engine cores that never outlive it.

A server stopped at any moment -- in its first second, while its engine cores load, while it serves,
while it drains -- exits (bounded) and leaves no process behind. "Loading" is made to last here, not
timed: the cores import a scheduler piece that, inside an engine core only, waits (up to two minutes)
as a slow model load would; the test waits until every core has said it is there. Every process this
file starts carries a tag in its environment, so whatever is left of it afterwards is found (and
killed, so that a failure cannot leak processes into the next test). No bound here is tight: they
tell "exited" from "ignored the signal", not fast from slow.
"""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("zmq", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from serverkit import WAIT_S, gone, wait_for  # noqa: E402

SLOW_PIECE = '''
import os, sys, time
from cbteach.engine.scheduler import Scheduler

if "engine_core" in " ".join(sys.argv):  # inside an engine core only: "load" for up to two minutes
    open(os.path.join(os.environ["SLOW_FLAGS"], str(os.getpid())), "w").close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


class SlowScheduler(Scheduler):
    pass
'''


def tagged(tag: str) -> list:
    """Live processes (not zombies) whose environment carries ``tag``."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("CBTEACH_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


class Server:
    """``python -m cbteach.serving.server --port 0 ARGS`` with a tag; everything tagged is killed on exit."""

    def __init__(self, tmp_path, args):
        self.tag, self.flags = uuid.uuid4().hex, tmp_path / "flags"
        self.flags.mkdir()
        (tmp_path / "slowload.py").write_text(SLOW_PIECE)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                   CBTEACH_TEST_TAG=self.tag, SLOW_FLAGS=str(self.flags),
                   PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cbteach.serving.server", "--port", "0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def loading(self) -> int:
        return len(list(self.flags.iterdir()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for p in tagged(self.tag):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.log.close()


@pytest.mark.parametrize("sig, cores", [(signal.SIGTERM, 1), (signal.SIGINT, 2)])
def test_a_signal_while_the_engine_cores_load_stops_the_server_and_every_core(tmp_path, sig, cores):
    with Server(tmp_path, ["--data-parallel-size", str(cores), "--scheduler", "slowload:SlowScheduler"]) as s:
        wait_for(lambda: s.loading() == cores or s.proc.poll() is not None, "every engine core to be loading",
                 timeout=120)
        assert s.proc.poll() is None, s.text()[-3000:]
        s.proc.send_signal(sig)
        assert s.proc.wait(WAIT_S) == 0, s.text()[-3000:]  # not the two minutes the cores would take
        assert f"stopped by {sig.name} before serving" in s.text()
        assert "Traceback" not in s.text()
        wait_for(lambda: not tagged(s.tag), "every engine core to be gone")


def test_engine_cores_die_with_a_killed_server_even_while_they_load(tmp_path):
    with Server(tmp_path, ["--data-parallel-size", "2", "--scheduler", "slowload:SlowScheduler"]) as s:
        wait_for(lambda: s.loading() == 2 or s.proc.poll() is not None, "both engine cores to be loading",
                 timeout=120)
        s.proc.kill()  # no handler runs: only the kernel (PR_SET_PDEATHSIG) or the cores' own watch can end them
        s.proc.wait(WAIT_S)
        wait_for(lambda: not tagged(s.tag), "the orphaned engine cores to exit by themselves")


@pytest.mark.parametrize("delay, sig", [(0.5, signal.SIGTERM), (1.5, signal.SIGTERM), (0.5, signal.SIGINT),
                                        (1.5, signal.SIGINT)])
def test_a_signal_in_the_first_seconds_stops_the_server_whatever_it_was_doing(tmp_path, delay, sig):
    """Importing, binding, starting cores, loading: wherever it is, it exits and leaves nothing running.
    ``import cbteach`` loads neither torch nor transformers (tests/test_packaging.py), so serve's own
    handler is in place within a fraction of a second; before it, SIGINT is Python's KeyboardInterrupt."""
    with Server(tmp_path, ["--data-parallel-size", "2"]) as s:
        time.sleep(delay)
        s.proc.send_signal(sig)
        s.proc.wait(WAIT_S)  # (its status depends on the moment: -15 in an import, 0 once main() runs)
        wait_for(lambda: not tagged(s.tag), "no process of the server to be left")


SLEEPER = "import time\ntime.sleep(120)\n"


@pytest.mark.parametrize("pdeathsig", ["1", "0"])
def test_parent_death_ends_the_child_by_the_kernel_signal_or_by_its_watch(tmp_path, pdeathsig):
    """A parent starts a child through parent_death.py and exits: the child ends (on Linux by
    PR_SET_PDEATHSIG with "1"; by the watch thread with "0", as everywhere else)."""
    from cbteach.serving import parent_death

    if pdeathsig == "1" and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    tag = uuid.uuid4().hex
    parent = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, sys.argv[1], str(os.getpid()), "
              "sys.argv[2], 'sleeper']); print(p.pid, flush=True)")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), CBTEACH_TEST_TAG=tag)
    out = subprocess.run([sys.executable, "-c", parent, parent_death.__file__, pdeathsig], env=env,
                         capture_output=True, text=True, timeout=WAIT_S)
    child = int(out.stdout.split()[0])
    try:
        wait_for(lambda: not tagged(tag), "the child to end with its parent")
        # A process on its way out has released its memory (so its environment reads empty and
        # tagged() no longer sees it) a moment before it becomes a zombie: wait for that moment too.
        wait_for(lambda: gone(child), "the child's process to be gone or a zombie")
    finally:
        for p in tagged(tag):
            p.kill()
