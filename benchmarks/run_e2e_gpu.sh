#!/usr/bin/env bash
# One device call of the end-to-end benchmark (`python -m fusekit.bench.e2e`) on a GPU host without a
# package index; successive calls merge into one file.
#
#   PROVIDERS=eager,fusekit-triton LAYERS=32 bash benchmarks/run_e2e_gpu.sh [more bench.e2e arguments]
#   PROVIDERS=liger LAYERS=32 MERGE_FROM=<files_at>/e2e/nvidia-h200/e2e-llama3-8b-32l.json bash ...
#
# Env: MODEL (llama3-8b), LAYERS (the model's default), PROVIDERS (eager,fusekit-triton,liger),
# BUDGET_S (480: no provider or case starts after it; the run is cut at BUDGET_S + 80 s, the file keeping
# every row measured before), MERGE_FROM (an e2e JSON an earlier call brought back: copied into
# place and merged into, --merge), DEVICE (cuda). Wheels in .whl/ (transformers and what the image lacks:
# huggingface_hub, tokenizers, safetensors, regex, click, hf-xet; liger-kernel) are installed into
# /tmp/e2e-site first; MAX staged by pack_max.sh (/tmp/maxsite/env.sh) is sourced for fusekit-mojo. The
# commit recorded is git's, or FUSEKIT_GIT_COMMIT / the first line of .whl/COMMIT when the copy has no .git.
# The results land in $OUT/e2e/<gpu slug>/ (the device tool brings $OUT back), else build/bench/e2e.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/e2e-site \
    .whl/*.whl || exit 9
  export PYTHONPATH="$PYTHONPATH:/tmp/e2e-site"
fi
# shellcheck disable=SC1091
if [ -f /tmp/maxsite/env.sh ]; then source /tmp/maxsite/env.sh; export PYTHONPATH="python:.:$PYTHONPATH"; fi
if [ -z "${FUSEKIT_GIT_COMMIT:-}" ] && ! git rev-parse HEAD >/dev/null 2>&1 && [ -f .whl/COMMIT ]; then
  export FUSEKIT_GIT_COMMIT FUSEKIT_GIT_DIRTY=0
  FUSEKIT_GIT_COMMIT=$(head -n 1 .whl/COMMIT)
fi
out=${OUT:-build/bench}/e2e
mkdir -p "$out"
merge=()
if [ -n "${MERGE_FROM:-}" ]; then
  slug=$(basename "$(dirname "$MERGE_FROM")")
  mkdir -p "$out/$slug" && cp "$MERGE_FROM" "$out/$slug/" && merge=(--merge)
fi
"$PY" -c "import transformers; print('transformers', transformers.__version__)" || exit 8
budget=${BUDGET_S:-480}
layers=()
if [ -n "${LAYERS:-}" ]; then layers=(--layers "$LAYERS"); fi
timeout "$((budget + 80))" "$PY" -m fusekit.bench.e2e --device "${DEVICE:-cuda}" --model "${MODEL:-llama3-8b}" \
  "${layers[@]}" --providers "${PROVIDERS:-eager,fusekit-triton,liger}" --budget-s "$budget" --out "$out" \
  "${merge[@]}" "$@"
rc=$?
find "$out" -name '*.json'
exit $rc
