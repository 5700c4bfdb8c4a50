"""The on-machine agent: GPU utilisation heartbeats to the scheduler's endpoint.

Standalone on purpose: it imports only the standard library (and NVML through nvidia-ml-py,
lazily), so the startup script can copy this one file onto a fresh machine and run it with any
python3 >= 3.8. It must never hurt the workload: every error is caught, logged and retried with
backoff; without NVML (no driver, no GPU) it reports "no gpu" instead of failing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
import urllib.error
import urllib.request
from typing import Any

MAX_BACKOFF_SECONDS = 300.0


class GPUReader:
    """Reads every GPU through NVML; returns ([], reason) when it cannot."""

    def __init__(self) -> None:
        self._nvml: Any = None  # the pynvml module once loaded

    def read(self):  # -> tuple[list[dict], str | None]
        try:
            if self._nvml is None:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            nv = self._nvml
            gpus = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                gpus.append(
                    {
                        "index": i,
                        "util": float(util.gpu),
                        "mem_used_mb": round(mem.used / 2**20),
                        "mem_total_mb": round(mem.total / 2**20),
                    }
                )
            return gpus, (None if gpus else "no gpu: NVML sees no device")
        except Exception as e:  # no nvidia-ml-py, no driver, a GPU fell off the bus…
            self._nvml = None
            return [], f"no gpu: {type(e).__name__}: {e}"[:200]


def post(endpoint: str, token: str, body: dict, timeout: float = 10.0) -> int:
    req = urllib.request.Request(
        endpoint.rstrip("/") + "/v1/heartbeat",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def run(
    endpoint: str,
    token_file: str,
    interval: float = 30.0,
    *,
    reader: GPUReader | None = None,
    sleep=time.sleep,
    stop=lambda: False,
    log=lambda msg: print(msg, file=sys.stderr, flush=True),
) -> None:
    """Post a heartbeat every ``interval`` seconds until ``stop()``; never raises."""
    reader = reader or GPUReader()
    failures = 0
    while not stop():
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
            gpus, note = reader.read()
            body = {"gpus": gpus}
            if note:
                body["note"] = note
            status = post(endpoint, token, body)
            if status != 200:
                raise RuntimeError(f"endpoint answered HTTP {status}")
            failures = 0
        except Exception as e:  # the token file is missing, the network is down, …
            failures += 1
            log(f"provisioner-agent: heartbeat failed ({failures}): {type(e).__name__}: {e}")
        wait = interval
        if failures:
            wait = min(interval * 2 ** min(failures, 10), MAX_BACKOFF_SECONDS)
            wait *= random.uniform(0.5, 1.0)
        sleep(wait)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="GPU heartbeats for the provisioner scheduler")
    p.add_argument("--endpoint", required=True, help="scheduler URL, e.g. http://10.0.0.5:8787")
    p.add_argument("--token-file", required=True)
    p.add_argument("--interval", type=float, default=30.0)
    a = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run(a.endpoint, a.token_file, a.interval)


if __name__ == "__main__":
    main()
