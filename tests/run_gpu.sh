#!/usr/bin/env bash
# The conformance suite on a GPU host (what the lead runs on the H200 through the device tool):
#   BACKENDS="torch triton mojo" bash tests/run_gpu.sh [extra pytest args]
# Runs the cross-backend files (conformance forward + backward, hostile inputs, fuzz, layouts, CUDA graphs,
# rope positions, out of memory, concurrency, any device) and the backend's own tests/test_<backend>_*.py
# with --device cuda once per backend (all dtypes, the CPU shapes plus the benchmark-sized CUDA shapes),
# with one log per backend in $OUT. LARGE=1 adds tests/test_large_index.py (inputs past 2^31 elements:
# minutes and ~60 GB). Each backend's JUnit XML (tests-<backend>.xml) becomes $OUT/reliability-<backend>.json
# (tests/reliability.py: cases per check, commit, GPU, versions); the XML is then removed to keep $OUT to
# two files per backend (KEEP_JUNIT=1 keeps it).
# MAX/Mojo staged by shared/gpu-env/pack_max.sh (/tmp/maxsite/env.sh) are put on the path.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
if [ -f /tmp/maxsite/env.sh ]; then source /tmp/maxsite/env.sh; fi
export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
rc=0
for b in ${BACKENDS:-torch triton mojo}; do
  echo "=== conformance, backend=$b, device=cuda"
  files="tests/test_conformance.py tests/test_hostile_inputs.py tests/test_fuzz.py tests/test_layouts.py"
  files="$files tests/test_cuda_graphs.py tests/test_rope_positions.py tests/test_out_of_memory.py"
  files="$files tests/test_concurrency.py tests/test_any_device.py"
  if [ "${LARGE:-0}" = 1 ]; then files="$files tests/test_large_index.py"; fi
  if [ "$b" != torch ]; then files="$files $(ls tests/test_"$b"_*.py 2>/dev/null | tr '\n' ' ')"; fi
  # shellcheck disable=SC2086
  python3 -m pytest $files --device cuda --backends "$b" -q -ra -p no:cacheprovider "$@" \
    --junitxml "$out/tests-$b.xml" -o junit_suite_name="$b-cuda" > "$out/tests-$b.log" 2>&1 || rc=1
  grep -E "passed|failed|error" "$out/tests-$b.log" | tail -n 3
  grep -E "^(FAILED|ERROR)" "$out/tests-$b.log" | head -n 20
  if python3 tests/reliability.py --out "$out/reliability-$b.json" "$out/tests-$b.xml" "$out/tests-$b.log" \
    && [ "${KEEP_JUNIT:-0}" != 1 ]; then
    rm -f "$out/tests-$b.xml"
  fi
done
exit $rc
