#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels bench/gpu_check.sh installs on a GPU machine
# that has no network (Python 3.12, CUDA 13, torch and cupy already there) into .whl/.
# Usage: bash bench/gpu_wheels.sh [PYTHON_VERSION]   (about 10 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do plat+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${plat[@]}" \
    -d .whl crc32c zarr numcodecs donfig google-crc32c msgspec kvikio-cu13 libkvikio-cu13 rapids-logger torchao
ls -la .whl
