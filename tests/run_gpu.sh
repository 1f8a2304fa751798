#!/usr/bin/env bash
# The conformance suite on a GPU host (what the lead runs on the H200 through the device tool):
#   BACKENDS="torch triton mojo" bash tests/run_gpu.sh [extra pytest args]
# Runs tests/test_conformance.py --device cuda once per backend (all dtypes, the CPU shapes plus the
# benchmark-sized CUDA shapes), then the CUDA-only runtime tests, with one log per backend in $OUT.
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
  python3 -m pytest tests/test_conformance.py --device cuda --backends "$b" -q -ra -p no:cacheprovider "$@" \
    > "$out/tests-$b.log" 2>&1 || rc=1
  grep -E "passed|failed|error" "$out/tests-$b.log" | tail -n 3
  grep -E "^(FAILED|ERROR)" "$out/tests-$b.log" | head -n 20
done
if [[ " ${BACKENDS:-mojo} " == *" mojo "* ]]; then
  echo "=== mojo runtime tests on cuda"
  python3 -m pytest tests/test_mojo_runtime.py -q -ra -p no:cacheprovider > "$out/tests-mojo-runtime.log" 2>&1 || rc=1
  tail -n 3 "$out/tests-mojo-runtime.log"
fi
exit $rc
