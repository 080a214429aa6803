#!/usr/bin/env bash
# Runs rtp's compiled code (rtp/kernels/csrc/*.c through rtp/kernels/_cpu_kernels.pyx, and rtp/runtime/*.pyx)
# under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# What it does:
#   1. copies the working tree (no .git, no .venv, no built extensions) to a scratch directory,
#      so the checkout's own rtp/*.so, which everyone's tests import, are never replaced;
#   2. builds the extensions there with RTP_SANITIZE (setup.py: -fsanitize=..., -g, -O1,
#      frame pointers), fetching Cython into the scratch directory if the venv lacks it;
#   3. runs the tests that drive the kernels, CPU graphs, the runtime and the engine against
#      that build, with the sanitizer runtimes preloaded (Python itself is not sanitized),
#      and fails when any sanitizer wrote a report (reports go to files, since pytest would
#      hide those of passing tests).
#
# ASan sees every plain AVX-512 load and store the kernels make (GCC's _mm*_storeu_* are
# ordinary C stores; checked: a 32-byte store past a buffer is reported), but not gathers,
# masked loads or AMX tile loads/stores. tests/kernels/test_kernel_bounds.py (in the default list)
# checks every kernel's stores with canary bytes instead, in any build and on AMX too.
#
# Usage:  tools/sanitize.sh [pytest args...]        e.g. tools/sanitize.sh -k rope
#         RTP_SANITIZE=address tools/sanitize.sh     (default: address,undefined)
#         RTP_SANITIZE_DIR=/tmp/x tools/sanitize.sh  (reuse a scratch dir: skips the rebuild
#                                                    when its build is newer than the sources)
#         RTP_SANITIZE_TESTS="tests/models/test_rotary.py" tools/sanitize.sh
# Time here (2 cores, AVX-512 BF16, no AMX), measured 2026-12-01: the build 88 s from scratch,
# 22 s when only the kernels changed; the default tests 2 min 45 s with the machine to itself
# (engine/test_engine.py and models/test_models.py are 2.5 min of it), 30 min while two other suites ran.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SAN=${RTP_SANITIZE:-address,undefined}
WORK=${RTP_SANITIZE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/rtp-sanitize.XXXXXX")}
TREE=$WORK/tree
LOGS=$WORK/logs
TESTS=${RTP_SANITIZE_TESTS:-"tests/kernels tests/runtime tests/engine/test_engine.py
    tests/engine/test_sampler.py tests/models/test_rotary.py tests/models/test_models.py"}
PYTHON=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || command -v python3)}

mkdir -p "$TREE" "$LOGS"
rm -f "$LOGS"/*
# the sources, fresh each run (a stale copy would test old code)
tar -C "$ROOT" --exclude=./.git --exclude=./.venv --exclude='*.so' --exclude=./build --exclude=.pytest_cache \
    --exclude=.hypothesis --exclude=__pycache__ -cf - . | tar -C "$TREE" -xf -

DEPS=$WORK/deps
if ! "$PYTHON" -c "import Cython" 2>/dev/null && ! PYTHONPATH=$DEPS "$PYTHON" -c "import Cython" 2>/dev/null; then
    "$PYTHON" -m pip install -q --target "$DEPS" "Cython>=3.0"
fi

cd "$TREE"
echo "== building with -fsanitize=$SAN in $TREE" >&2
start=$(date +%s)
force=()  # build_ext skips extensions newer than their sources: not when the sanitizers changed
[ "$(cat "$WORK/sanitizers" 2>/dev/null)" = "$SAN" ] || force=(--force)
RTP_SANITIZE=$SAN PYTHONPATH=$DEPS "$PYTHON" setup.py build_ext --inplace -j 2 "${force[@]}" >"$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log"; exit 1; }
echo "$SAN" >"$WORK/sanitizers"
echo "== built in $(( $(date +%s) - start )) s" >&2

preload=()
[[ ",$SAN," == *,address,* ]] && preload+=("$(gcc -print-file-name=libasan.so)")
[[ ",$SAN," == *,undefined,* ]] && preload+=("$(gcc -print-file-name=libubsan.so)")

# detect_leaks=0: Python and torch hold their memory to the end by design. ASan stops at the
# first bad access (the one to read); UBSan logs every report and goes on.
run() {
    env LD_PRELOAD="${preload[*]}" \
        ASAN_OPTIONS="detect_leaks=0:log_path=$LOGS/asan:${ASAN_OPTIONS:-}" \
        UBSAN_OPTIONS="print_stacktrace=1:log_path=$LOGS/ubsan:${UBSAN_OPTIONS:-}" \
        PYTHONPATH="$TREE" "$PYTHON" "$@"
}
# the editable install in the venv points at the checkout: make sure the copy is what runs
run -c "import rtp.kernels._cpu_kernels as k, sys
from rtp.runtime import block_allocator, common, radix_cache, scheduler, step_plan
mods = (k, block_allocator, common, radix_cache, scheduler, step_plan)
sys.exit(not all(m.__file__.startswith('$TREE') for m in mods))" \
    || { echo "== the sanitized extensions are not the ones imported" >&2; exit 1; }

start=$(date +%s)
set +e
run -m pytest -q -p no:cacheprovider $TESTS "$@"
status=$?
set -e
echo "== tests ran in $(( $(date +%s) - start )) s (pytest exit $status)" >&2

if compgen -G "$LOGS/*" >/dev/null; then
    echo "== SANITIZER REPORTS ($LOGS):" >&2
    cat "$LOGS"/* >&2
    exit 1
fi
echo "== no sanitizer reports" >&2
exit $status
