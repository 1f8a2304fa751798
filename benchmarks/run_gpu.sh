#!/usr/bin/env bash
# The full GPU benchmark run (what the lead runs on the H200 through the device tool).
#
#   bash benchmarks/run_gpu.sh [python -m fusekit.bench arguments...]
#   e.g. bash benchmarks/run_gpu.sh --ops reduce_sum,rms_norm,layer_norm,rope
#        bash benchmarks/run_gpu.sh --ops swiglu_ffn,attention
#        bash benchmarks/run_gpu.sh --quick                      # smoke test, all ops
#
# Writes benchmarks/results/<gpu-slug>/<op>.json (one file per op, rewritten after each op finishes).
# When $OUT is set (device tool), it also leaves there ONE tarball of that results folder and the log,
# so the files come back (the tool returns at most 8 files, 2 folders deep):
#   tar -xzf <files_at>/results-<gpu-slug>.tar.gz -C /work/main      # then: python -m fusekit.report
#
# Env: BUDGET_S (default 480): the harness starts no new case after this many seconds, so one call stays
# inside the device tool's 600 s limit; PYTHON (default python3). MAX/Mojo, if staged with
# shared/gpu-env/pack_max.sh (/tmp/maxsite/env.sh exists), are put on the path for the mojo backend and
# the MAX attention baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# shellcheck disable=SC1091
if [ -f /tmp/maxsite/env.sh ]; then source /tmp/maxsite/env.sh; export PYTHONPATH="python:.:$PYTHONPATH"; fi
PY=${PYTHON:-python3}
out=${OUT:-}
log=${out:-/tmp}/bench.log

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv || true
slug=$("$PY" -c "import torch; from fusekit.bench.results import slug; print(slug(torch.cuda.get_device_name()))")
rc=0
"$PY" -m fusekit.bench --device cuda --no-progress --budget-s "${BUDGET_S:-480}" "$@" 2>&1 | tee "$log" || rc=$?
if [ -n "$out" ] && [ -d "benchmarks/results/$slug" ]; then
  tar -czf "$out/results-$slug.tar.gz" "benchmarks/results/$slug"
  echo "results: \$OUT/results-$slug.tar.gz ($(ls "benchmarks/results/$slug" | tr '\n' ' '))"
fi
exit "$rc"
