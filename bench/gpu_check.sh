#!/usr/bin/env bash
# One script for a lent GPU machine: install the CUDA extras, report the GPU, driver and
# GPUDirect Storage state, run the GPU tests, then the GPU transfer benchmark.
# Usage: bash bench/gpu_check.sh   (about 5 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q -e '.[cu12,test]' || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
try:
    import kvikio, kvikio.defaults
    print("kvikio", getattr(kvikio, "__version__", "?"))
    from tierstore.engine.kvikio_engine import detect
    print("engine:", detect())
except Exception as e:
    print("kvikio unavailable:", e)
PY
python -m pytest -q -m gpu tests/ 2>&1 | tail -15
python bench/gpu_transfer.py
