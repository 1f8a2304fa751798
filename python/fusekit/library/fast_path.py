"""A planned signature's call as one generated function: allocate the outputs and launch, nothing else.

`plan._execute` serves every plan (contiguous copies, strided or staged outputs, empty problems, outputs
written into inputs) through six frames: `_execute`, `_allocate`, `outputs.empty`, `_launch_phase`,
`_launch_on`, `_launch`, each asking its own questions per call. A remembered call of a plain signature
(the decode step's norms, rope, attention) needs only the last: `compile_run` writes, once per plan, a
function that allocates the outputs with their sizes and dtypes as constants (scratch views where the
caller throws a statistic away) and calls `plan._launch` (the recorded launches' replay, or the provider;
looked up per call, so a wrapper such as bench.e2e's kernel_runs sees every call).
Poisoned outputs (tests), an open autocast region and a tensor on a GPU other than the current one take
the general path, as before; out of memory raises the same named error as `_allocate`.
FUSEKIT_FAST_PATH=0 (or `ENABLED = False` before a plan is remembered) keeps every call on `_execute`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from fusekit import outputs
from fusekit.library import plan as P
from fusekit.ops import _amp
from fusekit.ops._spec import OpSpec

ENABLED = os.environ.get("FUSEKIT_FAST_PATH", "1") not in ("", "0")  # "0": every call through _execute
_CODE: dict[str, Any] = {}  # source -> compiled code: one compile per call structure, not per signature


def compile_run(
    spec: OpSpec, phase: str, plan: P._Plan, scratch: tuple | None = None
) -> Callable[[tuple], tuple] | None:
    """`run(inputs) -> outputs` for `plan` (same results as `plan._execute(spec, phase, plan, inputs,
    False, scratch)`), or None where the plan needs the general path on every call: contiguous copies,
    outputs in an input's memory order, staged outputs, an empty problem."""
    if not ENABLED or plan.contig or plan.strides is not None or plan.staged or plan.empty:
        return None
    ns: dict[str, Any] = {
        "_out": outputs,
        "_empty": torch.empty,
        "_OOM": torch.OutOfMemoryError,
        "_amp_any": _amp.any_enabled,
        "_current": P._current_device,
        "_P": P,  # its functions looked up per call, as _execute does (bench.e2e.kernel_runs wraps _launch)
        "_spec": spec,
        "_phase": phase,
        "_plan": plan,
        "_scratch": scratch,
        "_dev": plan.device,
    }
    items = []
    for j, lay in enumerate(plan.layout):
        if lay is None:
            items.append("None")
        elif scratch is not None and scratch[j] is not None:
            ns[f"_s{j}"] = scratch[j]
            items.append(f"_s{j}")
        else:
            ns[f"_d{j}"] = lay[1]
            dims = ", ".join(str(int(n)) for n in lay[0]) if len(lay[0]) else "()"
            items.append(f"_empty({dims}, dtype=_d{j}, device=_dev)")
    # sizes as separate literal arguments: torch's parser takes them faster than a Size (outputs.empty)
    guard = f" or _current() != {plan.device.index}" if plan.guard else ""
    src = "\n".join(
        [
            "def run(inputs):",
            "    if _out._poison:",
            "        return _P._execute(_spec, _phase, _plan, inputs, False, _scratch)",
            "    try:",
            f"        outs = ({', '.join(items)},)",
            "    except _OOM as exc:  # named as _allocate names it; what was allocated is freed with the frame",
            "        raise _P.out_of_memory(_spec, _phase, _plan, exc) from exc",
            f"    if _amp_any(){guard}:",
            "        _P._launch_phase(_spec, _phase, _plan, outs, inputs, _dev, False)",
            "    else:",
            "        _P._launch(_spec, _phase, _plan, outs, inputs)",
            "    return outs",
        ]
    )
    code = _CODE.get(src)
    if code is None:
        if len(_CODE) >= 1024:
            _CODE.clear()
        code = _CODE[src] = compile(src, f"<fusekit {spec.name} {phase} run>", "exec")
    exec(code, ns)  # our own generated source
    return ns["run"]
