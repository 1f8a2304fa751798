#!/usr/bin/env bash
# The conformance suite on a GPU host (what the lead runs on the H200 through the device tool):
#   BACKENDS="torch triton mojo" bash tests/run_gpu.sh [extra pytest args]
# Runs the cross-backend files (conformance forward + backward, hostile inputs, fuzz, layouts, CUDA graphs,
# rope positions, out of memory, concurrency, any device) and the backend's own tests/test_<backend>_*.py
# with --device cuda once per backend (all dtypes, the CPU shapes plus the benchmark-sized CUDA shapes),
# with one log per backend in $OUT. LARGE=1 adds tests/test_large_index.py (inputs past 2^31 elements:
# minutes and ~60 GB). Each backend's JUnit XML (tests-<backend>.xml) becomes $OUT/reliability-<backend>.json
# (tests/reliability.py: cases per check, commit, GPU, versions); the XML is then removed to keep $OUT to
# two files per backend (KEEP_JUNIT=1 keeps it). NPROC=N runs the per-case files in N pytest-xdist workers
# and the whole-GPU checks (CUDA graphs, out of memory, concurrency, any device) after them in one process
# (tests-<backend>-serial.log); PART_S caps each pytest run (seconds, default 3000). Where pytest-timeout is
# installed (the GPU image has it), TEST_S (default 300) fails a single test that runs longer, by name: a hung
# or slow test under xdist otherwise left only dots in the log when PART_S (or the device call) cut the run.
# MAX/Mojo staged by shared/gpu-env/pack_max.sh (/tmp/maxsite/env.sh) are put on the path.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
if [ -f /tmp/maxsite/env.sh ]; then source /tmp/maxsite/env.sh; fi
export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
rc=0
per_test=()
if python3 -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout "${TEST_S:-300}"); fi
for b in ${BACKENDS:-torch triton mojo}; do
  echo "=== conformance, backend=$b, device=cuda"
  files="tests/test_conformance.py tests/test_hostile_inputs.py tests/test_fuzz.py tests/test_layouts.py"
  files="$files tests/test_rope_positions.py"
  if [ "${LARGE:-0}" = 1 ]; then files="$files tests/test_large_index.py"; fi
  if [ "$b" != torch ]; then files="$files $(ls tests/test_"$b"_*.py 2>/dev/null | tr '\n' ' ')"; fi
  # whole-GPU checks (memory pressure, streams, graphs, devices): one process, never beside xdist workers
  serial="tests/test_cuda_graphs.py tests/test_out_of_memory.py tests/test_concurrency.py tests/test_any_device.py"
  xdist=()
  if [ "${NPROC:-1}" -gt 1 ]; then xdist=(-n "$NPROC"); else files="$files $serial"; serial=""; fi
  logs=""
  for part in main serial; do
    if [ "$part" = main ]; then these=$files stem=tests-$b; else these=$serial stem=tests-$b-serial; fi
    [ -n "$these" ] || continue
    # shellcheck disable=SC2086
    timeout "${PART_S:-3000}" python3 -m pytest $these --device cuda --backends "$b" -v -ra --durations=20 -p no:cacheprovider \
      "${xdist[@]+"${xdist[@]}"}" "${per_test[@]+"${per_test[@]}"}" "$@" --junitxml "$out/$stem.xml" -o junit_suite_name="$b-cuda" \
      > "$out/$stem.log" 2>&1 || rc=1
    xdist=()  # the serial part runs in one process
    grep -E "passed|failed|error" "$out/$stem.log" | tail -n 3
    # -v names each result as it lands (xdist's -q printed dots): a run cut by PART_S still names its failures
    grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR) " "$out/$stem.log" | head -n 20
    logs="$logs $out/$stem.xml $out/$stem.log"
  done
  # shellcheck disable=SC2086
  if python3 tests/reliability.py --out "$out/reliability-$b.json" $(ls $logs 2>/dev/null) \
    && [ "${KEEP_JUNIT:-0}" != 1 ]; then
    rm -f "$out"/tests-"$b".xml "$out"/tests-"$b"-serial.xml
  fi
done
exit $rc
