#!/usr/bin/env bash
# The GPU machine's one call (see bench/gpu.py and the README's "Development" section).
# Here first, once:  bash ../shared/recipes/gpu/fetch-wheels.sh .whl   (the Jupyter stack the
# GPU image lacks); then on the device machine, carrying .whl:  bash bench/gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
  echo "$PWD" > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/nl-dev.pth"
fi
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt" | head -15
python3 bench/gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
