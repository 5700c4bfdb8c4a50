"""Named points where a test can kill the process (SIGKILL) to prove that a rerun converges.

``PROVISIONER_CRASH_AT=after-launch provisioner up x.yaml`` dies right after the cloud created
the machine and before the state recorded it. Costs one dictionary lookup when unset.
"""

from __future__ import annotations

import os
import signal


def crashpoint(name: str) -> None:
    if os.environ.get("PROVISIONER_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
