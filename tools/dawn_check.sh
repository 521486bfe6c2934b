#!/bin/bash
# One device call for the Dawn runtime (issue 20): tools/bench_gpu.py on Dawn and on wgpu-native side
# by side, then the GPU test files under both runtimes (what time is left). Results land in $OUT as they finish
# (a run cut short by its time limit keeps the finished parts):
#   tests_<runtime>.txt   pytest's summary (counts, failures with their messages)
#   bench_<runtime>.json  bench_gpu's JSON
#   extra.txt             whatever DAWN_CHECK_EXTRA runs (a command line), e.g. a kernel sweep
# Usage (from the checkout): OUT=/some/dir tools/dawn_check.sh [test seconds per runtime] [bench args...]
# Environment: DAWN_CHECK_RUNTIMES (tests; default "dawn wgpu"), DAWN_CHECK_BENCH (default "dawn wgpu"),
# DAWN_CHECK_TESTS (default tests/test_gpu_*.py), BENCH_SECS, EXTRA_SECS (time limits).
set -u
OUT=${OUT:-/tmp/dawn_check}
mkdir -p "$OUT"
secs=${1:-100}
shift || true
bench_args=("$@")
[ ${#bench_args[@]} -eq 0 ] && bench_args=(--formats f16 --no-torch --steps 32)
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}
tests=${DAWN_CHECK_TESTS:-$(ls tests/test_gpu_*.py)}

if [ -n "${DAWN_CHECK_EXTRA:-}" ]; then
    timeout "${EXTRA_SECS:-120}" bash -c "$DAWN_CHECK_EXTRA" >"$OUT/extra.txt" 2>&1
fi
for rt in ${DAWN_CHECK_BENCH:-dawn wgpu}; do
    timeout "${BENCH_SECS:-150}" python3 tools/bench_gpu.py --runtime "$rt" "${bench_args[@]}" >"$OUT/bench_$rt.json" 2>"$OUT/bench_$rt.err"
    tail -c 3000 "$OUT/bench_$rt.err" >>"$OUT/bench_$rt.json"
    rm -f "$OUT/bench_$rt.err"
done
for rt in ${DAWN_CHECK_RUNTIMES:-dawn wgpu}; do
    # One pytest per file, all within $secs: a file cut short by the deadline loses only itself.
    end=$((SECONDS + secs))
    for f in $tests; do
        left=$((end - SECONDS))
        [ $left -le 2 ] && { echo "$f: not run (deadline)" >>"$OUT/tests_$rt.txt"; continue; }
        echo "== $f" >>"$OUT/tests_$rt.txt"
        KJARNI_WEBGPU_RUNTIME=$rt timeout "$left" python3 -m pytest -p no:cacheprovider -q -rfEs --tb=line \
            --maxfail=20 "$f" 2>&1 | grep -v -E '^\.+ *(\[ *[0-9]+%\])?$|^$' >>"$OUT/tests_$rt.txt"
    done
done
grep -h -E "passed|failed|error" "$OUT"/tests_*.txt | tail -n 4
