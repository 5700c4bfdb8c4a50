"""The on-machine agent: GPU utilisation heartbeats to the scheduler's endpoint.

Standalone on purpose: it imports only the standard library (and NVML through nvidia-ml-py,
lazily), so the startup script can copy this one file onto a fresh machine and run it with any
python3 >= 3.8. It must never hurt the workload: every error is caught, logged and retried with
backoff; without NVML (no driver, no GPU) it reports "no gpu" instead of failing.

Each heartbeat is signed, so neither a listener on the network nor a replay can pass for the
machine: the key is the SHA-256 of the machine's token (what the scheduler stores), the
signature covers the machine id, the time in milliseconds (the scheduler refuses one older than
its window, or not newer than the last) and the body.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
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


SCHEME = "PV1-HMAC-SHA256"


def signing_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def signature(key: str, machine: str, at_ms: int, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = f"POST /v1/heartbeat\n{machine}\n{at_ms}\n{digest}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def authorization(key: str, machine: str, at_ms: int, body: bytes) -> str:
    sig = signature(key, machine, at_ms, body)
    return f"{SCHEME} machine={machine}, time={at_ms}, signature={sig}"


def parse_authorization(header: str):  # -> tuple[str, int, str] | None
    """(machine, time, signature) of a well-formed header, else None."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme != SCHEME or len(rest) > 512:
        return None
    fields = {}
    for part in rest.split(","):
        k, _, v = part.strip().partition("=")
        fields[k] = v
    machine, at, sig = (
        fields.get("machine", ""),
        fields.get("time", ""),
        fields.get("signature", ""),
    )
    if not (0 < len(machine) <= 64 and at.isdigit() and len(at) <= 15 and len(sig) == 64):
        return None
    return machine, int(at), sig


class Clock:
    """Milliseconds that always grow, so no two heartbeats carry the same time."""

    def __init__(self, now=time.time) -> None:
        self.now = now
        self.last = 0

    def ms(self) -> int:
        self.last = max(self.last + 1, int(self.now() * 1000))
        return self.last


def post(
    endpoint: str, machine: str, token: str, body: dict, at_ms: int, timeout: float = 10.0
) -> int:
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        endpoint.rstrip("/") + "/v1/heartbeat",
        data=data,
        headers={
            "Authorization": authorization(signing_key(token), machine, at_ms, data),
            "Content-Type": "application/json",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def run(
    endpoint: str,
    machine: str,
    token_file: str,
    interval: float = 30.0,
    *,
    reader: GPUReader | None = None,
    sleep=time.sleep,
    stop=lambda: False,
    log=lambda msg: print(msg, file=sys.stderr, flush=True),
    now=time.time,
) -> None:
    """Post a heartbeat every ``interval`` seconds until ``stop()``; never raises."""
    reader = reader or GPUReader()
    clock = Clock(now)
    failures = 0
    while not stop():
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
            gpus, note = reader.read()
            body = {"gpus": gpus}
            if note:
                body["note"] = note
            status = post(endpoint, machine, token, body, clock.ms())
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
    p.add_argument("--machine", required=True, help="this machine's id in the scheduler")
    p.add_argument("--token-file", required=True)
    p.add_argument("--interval", type=float, default=30.0)
    a = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run(a.endpoint, a.machine, a.token_file, a.interval)


if __name__ == "__main__":
    main()
