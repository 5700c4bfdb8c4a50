"""`provisioner scheduler run` as a real process for tests: started, and waited for until its
endpoint answers /healthz (imports and migrations done)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_scheduler(cfg: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """The daemon on ``cfg``, its stderr in ``log``, once ``/healthz`` on ``port`` answers."""
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "provisioner", "--config", str(cfg), "scheduler", "run"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(log.read_text()) from None
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the scheduler never answered /healthz:\n{log.read_text()}")
