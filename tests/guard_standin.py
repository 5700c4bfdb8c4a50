"""A minimal stand-in for the agent's guard (``provisioner/agent.py --state-dir …``), used by
tests/test_sandbox_guard.py only while the real agent does not take ``--state-dir`` yet: the
on_finish rule and ``--report``, in the formats of the guard design (guard.json, stop.json,
the report). Standard library only, run by path as the real agent is."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _jobs(jobs_dir: str) -> dict[str, str]:
    out = {}
    for job in sorted(os.listdir(jobs_dir)) if os.path.isdir(jobs_dir) else ():
        d = os.path.join(jobs_dir, job)
        if os.path.exists(os.path.join(d, "exit")):
            with open(os.path.join(d, "exit")) as f:
                out[job] = f"exit {f.read().strip()}"
        elif os.path.exists(os.path.join(d, "pid")):
            out[job] = "running"
    return out


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--state-dir", required=True)
    p.add_argument("--guard-file")
    p.add_argument("--shutdown-cmd", default="shutdown -h now")
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--report", action="store_true")
    p.add_argument("--since")
    p.add_argument("--boot-file")
    a = p.parse_args()
    d = a.state_dir
    guard_file = a.guard_file or os.path.join(d, "guard.json")
    if a.report:
        guard = _read(os.path.join(d, "guard.json"))
        print(
            json.dumps(
                {
                    "v": 1,
                    "machine": (guard or {}).get("machine"),
                    "at": _now(),
                    "boot": "standin",
                    "samples": [],
                    "jobs": _jobs((guard or {}).get("jobs_dir", "")),
                    "guard": guard,
                    "stop": _read(os.path.join(d, "stop.json")),
                }
            )
        )
        return 0
    while True:
        guard = _read(guard_file) or {}
        jobs = _jobs(guard.get("jobs_dir", ""))
        with open(os.path.join(d, "samples.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    {
                        "at": _now(),
                        "gpus": [],
                        "gpu_error": "no gpu",
                        "ssh": 0,
                        "jobs_running": [j for j, s in jobs.items() if s == "running"],
                    }
                )
            )
            f.write("\n")
        finish = guard.get("on_finish")
        if finish and jobs.get(finish["job"], "").startswith("exit "):
            stop = {
                "at": _now(),
                "reason": "on-finish",
                "action": finish["action"],
                "detail": f"job {finish['job']} {jobs[finish['job']]}",
                "jobs_ended": {},
            }
            with open(os.path.join(d, "stop.json"), "w") as f:
                json.dump(stop, f)
            subprocess.run(a.shutdown_cmd, shell=True, check=False)
            return 0
        time.sleep(a.interval)


if __name__ == "__main__":
    sys.exit(main())
