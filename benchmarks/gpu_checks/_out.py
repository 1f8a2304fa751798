"""Results of the gpu_checks scripts: the device tool brings back what a command writes under $OUT."""

from __future__ import annotations

import json
import os
from pathlib import Path


def save_json(name: str, obj: object) -> None:
    """obj as indented JSON in $OUT/name when $OUT is set (a device call); nothing otherwise."""
    out = os.environ.get("OUT")
    if out:
        Path(out, name).write_text(json.dumps(obj, indent=1))


def run_meta(**extra: object) -> dict:
    """Where a result was measured: GPU, torch/triton versions, the git commit (FUSEKIT_GIT_COMMIT, as the
    device scripts export it), the date; plus `extra`."""
    import datetime

    import torch
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_commit": os.environ.get("FUSEKIT_GIT_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
