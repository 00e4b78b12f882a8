"""An engine core ends when its API server dies, whatever it is doing -- even while it loads the model.

A core that outlives its server holds a model copy and processors for nobody. The core's busy loop
checks its parent every turn, but a core spends its first seconds importing torch and loading
weights, far from any loop; and a server stopped then (Ctrl-C, SIGTERM, SIGKILL, an OOM kill) would
leave it running until the load ends. So every core is started through this file, before any of
that:

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (through ``ctypes``): the kernel kills the core the
  moment the thread that started it exits -- so :class:`~.core_client.CoreClient` asks for it only
  when started from the main thread (a worker thread that starts cores and then ends would kill them);
* everywhere, a daemon thread that checks every :data:`WATCH_S` seconds that the parent is still
  the process that started it, and ends the core if not (``os._exit``: nothing left to flush);
* after either is in place, the parent is checked once: one that died before could not be noticed.

Then it runs ``python -m MODULE`` in this process (:func:`runpy.run_module`). Run as a script --
``python parent_death.py PARENT_PID USE_PDEATHSIG MODULE`` -- so that nothing heavy is imported
before the watch is on; it uses the standard library only.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

WATCH_S = 0.2
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies; False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent_pid: int, every: float = WATCH_S) -> threading.Thread:
    """A daemon thread that ends this process as soon as ``parent_pid`` is no longer its parent."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(every)

    t = threading.Thread(target=watch, name="cbteach-parent-watch", daemon=True)
    t.start()
    return t


def main(argv) -> None:
    parent_pid, use_pdeathsig, module = int(argv[0]), argv[1] == "1", argv[2]
    if use_pdeathsig:
        set_pdeathsig()
    if os.getppid() != parent_pid:  # it died before the watch was on
        os._exit(1)
    watch_parent(parent_pid)
    import runpy

    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # this folder's modules (metrics, faults...) must not shadow top-level ones
    main(sys.argv[1:])
