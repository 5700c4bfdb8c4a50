"""A team shares one state database: two `up` of the same name at once make one machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from provisioner.app import App
from provisioner.clock import CLOCK_ENV
from tests.conftest import (
    ROOT,
    TEST_START,
    make_settings,
    sandbox_experiment,
    write_settings,
    write_yaml,
)

pytestmark = pytest.mark.slow  # real processes racing


def test_two_ups_of_one_name_at_once_make_one_machine(home, tmp_path, db_url):
    cfg = write_settings(home, state_url=db_url, sandbox={"latency_seconds": 0.5})
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("twin"))
    cmd = [sys.executable, "-m", "provisioner", "--config", str(cfg), "up", str(spec), "-o", "json"]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, CLOCK_ENV: TEST_START.isoformat()},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    machines = [json.loads(out)["machine"] for out, _ in results]
    app = App(make_settings(home, state_url=db_url))
    launched = app.provider("sandbox").list_managed()
    assert len(launched) == 1
    assert {m["id"] for m in machines} == {launched[0].machine_id}
    app.close()
