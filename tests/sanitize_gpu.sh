#!/usr/bin/env bash
# compute-sanitizer over every kernel at small odd shapes (issue #15, item 1), on a GPU host:
#   BACKENDS="triton mojo" TOOLS="memcheck racecheck synccheck" bash tests/sanitize_gpu.sh [pytest args]
# Each tool runs the fast conformance subset (-m fast: the first two CPU cases of every op, dtype and
# phase, odd sizes included) and, for triton, the decode-attention and reduce_sum determinism tests (the
# kernel pairs launched with PDL), with --device cuda,
# under `compute-sanitizer --tool <tool> --error-exitcode 97`. One log per (backend, tool) in $OUT and a
# summary line each (also appended to its log): the sanitizer's "ERROR SUMMARY" (racecheck: "RACECHECK SUMMARY") and pytest's counts.
# Each run's JUnit XML and log become $OUT/reliability-sanitize-<backend>.json (tests/reliability.py);
# the XMLs are then removed to keep $OUT small (KEEP_JUNIT=1 keeps them). Needs no installs (nox
# sessions cannot create environments on the device machine); MAX staged by pack_max.sh is sourced.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
if [ -f /tmp/maxsite/env.sh ]; then source /tmp/maxsite/env.sh; fi
export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Triton and MAX compile on first use; the sanitizer slows kernels ~100x: keep the cases small.
export FUSEKIT_NORM_TUNE=0
# Every torch tensor its own cudaMalloc: memcheck then flags a kernel that reads or writes past its
# tensor (inside the caching allocator's shared segments such an access lands in a neighbour unseen;
# the mojo swiglu_ffn bug of 2026-11-23 zeroed the caller's input exactly that way).
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
out=${OUT:-/tmp}
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
rc=0
run() {  # run <log> <pytest args...>: one pytest process under the sanitizer
  local log=$1 code
  shift
  "$san" --tool "$tool" --error-exitcode 97 --print-limit 20 python3 -m pytest "$@" --device cuda \
    --backends "$b" -q -p no:cacheprovider --junitxml "${log%.log}.xml" -o junit_suite_name="$b-cuda" \
    > "$log" 2>&1
  code=$?
  [ $code -ne 0 ] && rc=1
  echo "$b $tool $(basename "$log") exit=$code $(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -n 1)" \
    "$(grep -E 'passed|failed' "$log" | tail -n 1)" | tee -a "$log"
}
for b in ${BACKENDS:-triton mojo}; do
  for tool in ${TOOLS:-memcheck racecheck synccheck}; do
    run "$out/sanitize-$b-$tool.log" tests/test_conformance.py -m fast "$@"
    if [ "$b" = triton ]; then
      run "$out/sanitize-$b-$tool-decode.log" tests/test_triton_decode_attention.py "$@"
      # reduce_sum's split + fixed-order finalize, launched with PDL on sm_90+
      run "$out/sanitize-$b-$tool-determinism.log" tests/test_triton_determinism.py "$@"
    fi
  done
  records=$(ls "$out"/sanitize-"$b"-*.xml "$out"/sanitize-"$b"-*.log 2>/dev/null)
  # shellcheck disable=SC2086
  if [ -n "$records" ] && python3 tests/reliability.py --out "$out/reliability-sanitize-$b.json" $records \
    && [ "${KEEP_JUNIT:-0}" != 1 ]; then
    rm -f "$out"/sanitize-"$b"-*.xml
  fi
done
exit $rc
