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
