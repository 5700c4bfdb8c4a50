"""CLI cold start: `provisioner --help` and `provisioner plan configs/examples/experiment.yaml`,
each in a fresh interpreter, against a bare `python -c pass` in the same run.

    .venv/bin/python bench/bench_cli.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], runs: int, env: dict[str, str]) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(
            cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    env = {**os.environ, "PROVISIONER_HOME": tempfile.mkdtemp()}
    py = sys.executable
    cases = {
        "python -c pass": [py, "-c", "pass"],
        "provisioner --help": [py, "-m", "provisioner", "--help"],
        "provisioner plan experiment.yaml": [
            py,
            "-m",
            "provisioner",
            "plan",
            "configs/examples/experiment.yaml",
        ],
        "provisioner catalog": [py, "-m", "provisioner", "catalog"],
    }
    base = None
    print(f"{'command':<36} {'min s':>7} {'median s':>9} {'× python':>9}")
    for name, cmd in cases.items():
        times = timed(cmd, args.runs, env)
        med = statistics.median(times)
        base = base or med
        print(f"{name:<36} {min(times):>7.3f} {med:>9.3f} {med / base:>9.1f}")


if __name__ == "__main__":
    main()
