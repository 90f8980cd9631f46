#!/usr/bin/env bash
# One script for a lent GPU machine: install tierstore (from PyPI, or from wheels carried
# in .whl/ where the machine has no network; see bench/gpu_wheels.sh), report the GPU,
# driver and GPUDirect Storage state, run the GPU tests, then the GPU benchmarks:
# transfers through the pinned arena, NVMe <-> GPU through KvikIO vs a host bounce, and an
# offloaded training step vs plain and torchao. Ends with the tables and JSON lines,
# also written under $OUT (or ./gpu-check-out). Usage: bash bench/gpu_check.sh  (~6 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site-ts . \
        || { echo "tierstore install failed"; exit 1; }
    export PYTHONPATH=/tmp/site-ts:/tmp/site
    PY=python3
else
    python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
    pip install -q -e '.[cu12,test]' || { echo "install failed"; exit 1; }
    PY=python
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
$PY - <<'PY' 2>&1 | tee "$out/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
from tierstore.engine.kvikio_engine import detect
print("kvikio engine:", detect())
from tierstore.gpu import detect_backend
print("GPU tier backend:", detect_backend()[1])
import resource
print("RLIMIT_MEMLOCK:", resource.getrlimit(resource.RLIMIT_MEMLOCK))
PY
$PY -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_tier.py 2>&1 | tee "$out/tests.txt" | tail -40
mkdir -p /tmp/bench-io && cd /tmp/bench-io && B="$OLDPWD/bench"
timeout 120 $PY "$B/gpu_transfer.py" 2>&1 | tee "$out/gpu_transfer.txt"
timeout 150 $PY "$B/gpu_nvme.py" --dir /tmp/bench-io/nvme --size 2GiB 2>&1 | tee "$out/gpu_nvme.txt"
timeout 240 $PY "$B/gpu_train.py" 2>&1 | tee "$out/gpu_train.txt"
