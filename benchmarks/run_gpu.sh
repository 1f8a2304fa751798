#!/usr/bin/env bash
# The full GPU benchmark run (what the lead runs on the H200 through the device tool).
#
#   bash benchmarks/run_gpu.sh [python -m fusekit.bench arguments...]
#   e.g. bash benchmarks/run_gpu.sh --suite sweep                   # the forward sweeps, all ops
#        bash benchmarks/run_gpu.sh --suite train,small             # training (fwd+bwd) and small shapes
#        bash benchmarks/run_gpu.sh --suite sweep --ops swiglu_ffn,attention
#        bash benchmarks/run_gpu.sh --quick                         # smoke test, all ops and suites
#
# Writes benchmarks/results/<gpu-slug>/<op>.json (sweep) and <op>.<suite>.json (train, small), one file
# per op and suite, rewritten after each op finishes.
# When $OUT is set (device tool), it also leaves there ONE tarball of that results folder and the log,
# so the files come back (the tool returns at most 8 files, 2 folders deep):
#   tar -xzf <files_at>/results-<gpu-slug>.tar.gz -C /work/main      # then: python -m fusekit.report
#
# Env: BUDGET_S (default 480, split 2/3 : 1/6 : 1/6 over the three processes below): no new case starts
# after it, so one call stays inside the device tool's 600 s limit; PYTHON (default python3). MAX/Mojo, if
# staged with shared/gpu-env/pack_max.sh (/tmp/maxsite/env.sh exists), are put on the path for the mojo
# backend and the MAX attention baseline. Liger-Kernel (an optional baseline, pure Python) is installed
# from .whl/liger_kernel-*.whl when that wheel was carried (the device machine has no package index).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# shellcheck disable=SC1091
if [ -f /tmp/maxsite/env.sh ]; then source /tmp/maxsite/env.sh; export PYTHONPATH="python:.:$PYTHONPATH"; fi
PY=${PYTHON:-python3}
if compgen -G ".whl/liger_kernel-*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/liger-site \
    .whl/liger_kernel-*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/liger-site"
fi
out=${OUT:-}
log=${out:-/tmp}/bench.log

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv || true
slug=$("$PY" -c "import torch; from fusekit.bench.results import slug; print(slug(torch.cuda.get_device_name()))")
rc=0
tmp=$(mktemp -d)
budget=${BUDGET_S:-480}
# Once MAX has run on the GPU its allocator keeps most of the card's memory, so torch's large reference
# tensors would no longer fit: the MAX-based providers (the mojo backend, MAX's attention) run in their
# own processes with MAX's pool capped, and fusekit.bench.merge joins the rows per op.
"$PY" -m fusekit.bench --device cuda --no-progress --budget-s "$((budget * 2 / 3))" --out "$tmp/a" \
  --backends torch,triton --baselines torch-eager,torch-compile,torch-native,cub,cublas,sdpa,liger "$@" 2>&1 |
  tee "$log" || rc=$?
export MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT=20
"$PY" -m fusekit.bench --device cuda --no-progress --budget-s "$((budget / 6))" --out "$tmp/b" \
  --backends mojo --baselines none "$@" 2>&1 | tee -a "$log" || rc=$?
"$PY" -m fusekit.bench --device cuda --no-progress --budget-s "$((budget / 6))" --out "$tmp/c" \
  --backends none --baselines max-attention "$@" 2>&1 | tee -a "$log" || rc=$?
mapfile -t files < <(ls "$tmp"/a/"$slug"/*.json "$tmp"/b/"$slug"/*.json "$tmp"/c/"$slug"/*.json 2>/dev/null)
if [ "${#files[@]}" -gt 0 ]; then "$PY" -m fusekit.bench.merge --out "benchmarks/results/$slug" "${files[@]}"; fi
if [ -n "$out" ] && [ -d "benchmarks/results/$slug" ]; then
  tar -czf "$out/results-$slug.tar.gz" "benchmarks/results/$slug"
  echo "results: \$OUT/results-$slug.tar.gz ($(ls "benchmarks/results/$slug" | tr '\n' ' '))"
fi
exit "$rc"
