#!/usr/bin/env bash
# One script for a lent GPU machine: install tierstore (from wheels carried in .whl/ where the
# machine has no network, see bench/gpu_wheels.sh; from PyPI otherwise), check that the
# installed package is the one that runs, report the GPU, driver and GPUDirect Storage state,
# start a daemon once, run the GPU tests, then the GPU benchmarks: transfers through the
# pinned arena, NVMe <-> GPU through KvikIO vs a host bounce, and an offloaded training step
# vs plain and torchao.
#
# Usage: bash bench/gpu_check.sh [--dry-run]
#   --dry-run   the same install and orchestration on a machine without a GPU (CI runs it):
#               the carried wheels are not installed (they are built for the device's
#               Python), tierstore is installed offline, GPU tests and benchmarks skip.
#
# It cannot hang: every step runs under a hard timeout (its process group is killed), the
# whole run stays inside GPU_CHECK_BUDGET_S (default 390 s, about 6.5 minutes), and a step
# that fails does not stop the ones after it. Everything it learns lands in $OUT (default
# ./gpu-check-out) as it goes, in at most 8 files:
#   steps.txt      one line per step: name, exit status, seconds (124: killed at its limit)
#   env.txt        install check, GPU, driver, torch, kvikio / GDS, memlock
#   tests.txt      the GPU tests
#   results.jsonl  one JSON line per measurement, written by each benchmark as it measures
#   transfer.txt, nvme.txt, train.txt   each benchmark's table and last JSON line
# Tests and benchmarks run from a directory outside the repository, against the installed
# package: run from the repository root, the source folder tierstore/ (which has no client/
# or daemon/: they are mapped by package-dir) would shadow it.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dry=0
for a in "$@"; do
    case "$a" in
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
    esac
done
out="${OUT:-$repo/gpu-check-out}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
# short paths: the daemons' sockets live under it (AF_UNIX paths are at most 107 bytes)
work="$(mktemp -d "${GPU_CHECK_WORK:-/tmp}/tsgc.XXXXXX")" || exit 1
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/run" "$work/io"
budget="${GPU_CHECK_BUDGET_S:-390}"
started=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TIERSTORE_BENCH_PARTIAL="$out/results.jsonl"
: > "$out/steps.txt"; : > "$out/results.jsonl"; : > "$out/env.txt"
PY="${PYTHON:-python3}"
fails=0

note() { echo "$*" | tee -a "$out/steps.txt"; }
note "work directory $work"

# step NAME LIMIT_S LOG CMD...: run CMD from $work/run under a hard timeout (capped by what
# is left of the budget), output to the terminal and appended to LOG, status to steps.txt.
step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((budget - (SECONDS - started)))
    if [ "$left" -lt 15 ]; then
        note "$name skipped: the run's budget of ${budget} s is spent"
        fails=$((fails + 1))
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit} s)" | tee -a "$log"
    local t0=$SECONDS
    (cd "$work/run" && exec timeout -k 10 "$limit" "$@") 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || fails=$((fails + 1))
    note "$name rc=$rc $((SECONDS - t0))s$([ "$rc" = 124 ] && echo " (killed at its ${limit} s limit)")"
    return "$rc"
}

# ------------------------------------------------------------------ install
site="$work/site"
if [ "$dry" = 1 ]; then
    n=$(ls "$repo"/.whl/*.whl 2>/dev/null | wc -l)
    note "dry run: $n carried wheel(s) left uninstalled; dependencies from $($PY -c 'import sys; print(sys.prefix)')"
elif ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
    step install-wheels 120 "$out/env.txt" "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$work/wheels" "$repo"/.whl/*.whl || exit 1
    export PYTHONPATH="$work/wheels${PYTHONPATH:+:$PYTHONPATH}"
else  # a machine with network: a fresh environment with the GPU extras
    step venv 240 "$out/env.txt" bash -c "$PY -m venv '$work/venv' && '$work/venv/bin/pip' install -q '$repo[cu12,test]'" \
        || exit 1
    PY="$work/venv/bin/python"
fi
if [ "$PY" != "$work/venv/bin/python" ]; then
    # tierstore itself, offline, into its own directory; where no build backend is at hand
    # (no setuptools / wheel in this environment) the package-dir layout is copied instead
    if ! step install-tierstore 120 "$out/env.txt" "$PY" -m pip install -q --no-index --no-deps \
            --no-build-isolation --no-compile --target "$site" "$repo"; then
        # a dry run expects this where no build backend is at hand; a device run goes on
        # (its time is scarce) but ends failed, so the install is looked at
        [ "$dry" = 1 ] && fails=$((fails - 1))
        step install-layout 30 "$out/env.txt" "$PY" "$repo/bench/gpu_probe.py" layout "$repo" "$site" || exit 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
step check-install 60 "$out/env.txt" "$PY" "$repo/bench/gpu_probe.py" check "$repo" || exit 1

# ------------------------------------------------------------------ what the machine has
command -v nvidia-smi >/dev/null && step nvidia-smi 30 "$out/env.txt" \
    nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv
step env 60 "$out/env.txt" "$PY" "$repo/bench/gpu_probe.py" env "$work/io"

# ------------------------------------------------------------------ one daemon, then the tests
step daemon-smoke 60 "$out/env.txt" "$PY" "$repo/bench/gpu_probe.py" smoke "$work/io"
tests=("$repo/tests/test_gpu.py" "$repo/tests/test_gpu_tier.py" "$repo/tests/test_cuda_fallback.py")
[ "$dry" = 1 ] && tests=("$repo/tests/test_gpu.py")  # all skip without CUDA: the collection is the check
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 90)
step tests 170 "$out/tests.txt" "$PY" -m pytest -q -p no:cacheprovider -rfEs "${per_test[@]}" \
    -o faulthandler_timeout=80 --rootdir "$repo" -c "$repo/pyproject.toml" "${tests[@]}"

# ------------------------------------------------------------------ benchmarks
B="$repo/bench"
if [ "$dry" = 1 ]; then sz=(--size 8MiB --threads 1 --task 1MiB); tr=(--layers 1 --width 64 --batch 8 --steps 1)
else sz=(--size 1GiB --threads 4,16 --task 4MiB,16MiB); tr=(--layers 8 --width 2048 --batch 1024 --steps 4); fi
step gpu_transfer 50 "$out/transfer.txt" "$PY" "$B/gpu_transfer.py"
step gpu_nvme 70 "$out/nvme.txt" "$PY" "$B/gpu_nvme.py" --dir "$work/io/nvme" "${sz[@]}"
step gpu_train 100 "$out/train.txt" "$PY" "$B/gpu_train.py" "${tr[@]}"
note "done in $((SECONDS - started)) s (budget ${budget} s), $fails step(s) failed; results in $out"
[ "$fails" = 0 ]
