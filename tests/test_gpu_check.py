"""tools/gpu_check.py (``make gpu-check``) off a GPU: it refuses at once and says why, and a signal
stops the whole run (not just the notebook that is running), leaving no notebook process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_full_check_refuses_at_once(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "gpu.json")], capture_output=True,
                         text=True, timeout=120, env=ENV)
    assert out.returncode == 2
    assert "no GPU here" in out.stderr and "--small" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_whole_run(sig, tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--small", "--out", str(tmp_path / "gpu.json")],
                                stdout=f, stderr=subprocess.STDOUT, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while "notebook 00" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert "notebook 00" in log.read_text(), log.read_text()[-2000:]
        time.sleep(3)  # the notebook's own process is starting or running
        proc.send_signal(sig)
        assert proc.wait(timeout=90) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    text = log.read_text()
    assert f"stopped by {signal.Signals(sig).name}" in text and "notebook 01" not in text
    time.sleep(1)
    children = subprocess.run(["pgrep", "-f", f"run-notebook .*notebook-{proc.pid}[.]json"], capture_output=True,
                              text=True)
    assert children.stdout.strip() == ""
