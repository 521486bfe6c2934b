#!/bin/bash
# One device call for the Dawn runtime (issue 20): tools/bench_gpu.py on Dawn and on wgpu-native side
# by side (per format, the two runtimes one after the other), then the GPU test files under both
# runtimes. Results land in $OUT as they finish (a run cut short by its time limit keeps the
# finished parts):
#   extra.txt             whatever DAWN_CHECK_EXTRA runs first (a command line), e.g. a kernel sweep
#   bench_<runtime>.json  bench_gpu's JSON, one report per format
#   tests_<runtime>.txt   pytest's summary per test file (counts, failures with their messages)
# Usage (from the checkout): OUT=/some/dir tools/dawn_check.sh [test seconds] [bench args...]
# Environment: DAWN_CHECK_RUNTIMES (tests; default "dawn wgpu"), DAWN_CHECK_BENCH (default "dawn wgpu"),
# DAWN_CHECK_FORMATS (default f16; one bench_gpu run per format and runtime), DAWN_CHECK_DAWN_ARGS
# (bench arguments for Dawn only, e.g. --dawn-fast --sgmat-choice FILE), DAWN_CHECK_TESTS (default
# tests/test_gpu_*.py), DAWN_CHECK_JOBS (test files run at once, all runtimes together; default 1),
# BENCH_SECS (per bench run), EXTRA_SECS (time limits).
set -u
OUT=${OUT:-/tmp/dawn_check}
mkdir -p "$OUT"
secs=${1:-100}
shift || true
bench_args=("$@")
[ ${#bench_args[@]} -eq 0 ] && bench_args=(--no-torch --steps 32)
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}
tests=${DAWN_CHECK_TESTS:-$(ls tests/test_gpu_*.py)}

if [ -n "${DAWN_CHECK_EXTRA:-}" ]; then
    timeout "${EXTRA_SECS:-120}" bash -c "$DAWN_CHECK_EXTRA" >"$OUT/extra.txt" 2>&1
fi
for fmt in ${DAWN_CHECK_FORMATS:-f16}; do
    for rt in ${DAWN_CHECK_BENCH:-dawn wgpu}; do
        extra=()
        [ "$rt" = dawn ] && extra=(${DAWN_CHECK_DAWN_ARGS:-})
        timeout "${BENCH_SECS:-150}" python3 tools/bench_gpu.py --runtime "$rt" --formats "$fmt" "${bench_args[@]}" "${extra[@]}" \
            >>"$OUT/bench_$rt.json" 2>"$OUT/bench_$rt.err"
        tail -c 1500 "$OUT/bench_$rt.err" >>"$OUT/bench_$rt.json"
        rm -f "$OUT/bench_$rt.err"
    done
done
# One pytest per (runtime, file), DAWN_CHECK_JOBS at once, all within $secs: a file cut short by the
# deadline loses only itself. Each writes its own part; the parts are joined per runtime in order.
parts=$(mktemp -d)
for rt in ${DAWN_CHECK_RUNTIMES:-dawn wgpu}; do
    for f in $tests; do echo "$rt $f"; done
done | KJ_SECS=$secs KJ_PARTS=$parts xargs -P "${DAWN_CHECK_JOBS:-1}" -L 1 bash -c '
    out="$KJ_PARTS/$0.$(basename "$1").txt"
    echo "== $1" >"$out"
    KJARNI_WEBGPU_RUNTIME=$0 timeout "$KJ_SECS" python3 -m pytest -p no:cacheprovider -q -rfEs --tb=line \
        --maxfail=20 "$1" 2>&1 | grep -v -E "^[.sFE]+ *(\[ *[0-9]+%\])?$|^$" >>"$out"
    [ ${PIPESTATUS[0]} -eq 124 ] && echo "$1: cut short by the deadline ($KJ_SECS s)" >>"$out"
    true'
for rt in ${DAWN_CHECK_RUNTIMES:-dawn wgpu}; do
    for f in $tests; do cat "$parts/$rt.$(basename "$f").txt" 2>/dev/null; done >"$OUT/tests_$rt.txt"
done
rm -rf "$parts"
grep -h -E "^== |passed|failed|error" "$OUT"/tests_*.txt | tail -n 40
