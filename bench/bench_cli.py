"""CLI cold start: `provisioner --help` and `provisioner plan configs/examples/experiment.yaml`,
each in a fresh interpreter, against a bare `python -c pass` in the same run.

    .venv/bin/python bench/bench_cli.py [--runs 15] [--sky PATH-TO-sky]

With ``--sky`` (SkyPilot installed in a venv of its own) its `sky --help` and `sky show-gpus`
run in the same loop, for the ratio.
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


def timed(cmd: list[str], runs: int, env: dict[str, str]) -> tuple[list[float], int]:
    out, code = [], 0
    for _ in range(runs):
        t = time.perf_counter()
        code = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ).returncode
        out.append(time.perf_counter() - t)
    return out, code


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--sky", help="path to SkyPilot's `sky`, to measure it in the same run")
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
        "provisioner status (empty state)": [py, "-m", "provisioner", "status"],
    }
    if args.sky:
        cases["sky --help (SkyPilot)"] = [args.sky, "--help"]
        cases["sky show-gpus A100:8 (SkyPilot)"] = [args.sky, "show-gpus", "A100:8"]
    base = None
    medians = {}
    print(f"{'command':<36} {'min s':>7} {'median s':>9} {'× python':>9} {'exit':>5}")
    for name, cmd in cases.items():
        times, code = timed(cmd, args.runs, env)
        med = medians[name] = statistics.median(times)
        base = base or med
        print(f"{name:<36} {min(times):>7.3f} {med:>9.3f} {med / base:>9.1f} {code:>5}")
    if args.sky:
        ratio = medians["sky --help (SkyPilot)"] / medians["provisioner --help"]
        print(f"`provisioner --help` starts {ratio:.1f}x faster than `sky --help` (same run)")


if __name__ == "__main__":
    main()
