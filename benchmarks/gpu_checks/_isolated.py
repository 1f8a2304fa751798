"""One case of a gpu_checks script in its own process (a hang or a fault kills only that case)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def run_case(script: str, args: list[str], timeout: float, timeout_status: str) -> tuple[str, float, str]:
    """`python script --child <args>` in its own process group, killed after `timeout` s: (status "ok",
    "ERROR rc=N" or `timeout_status`; seconds; its last output line, or the last three for an error)."""
    t = time.time()
    p = subprocess.Popen([sys.executable, os.path.abspath(script), "--child", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = p.communicate(timeout=timeout)
        status = "ok" if p.returncode == 0 else f"ERROR rc={p.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # this case's own process group only
        out, _ = p.communicate()
        status = timeout_status
    lines = [ln for ln in (out or "").splitlines() if ln.strip()]
    last = " | ".join(lines[-3:]) if status.startswith("ERROR") else (lines[-1] if lines else "")
    return status, time.time() - t, last
