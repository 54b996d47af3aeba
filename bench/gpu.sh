#!/usr/bin/env bash
# The GPU machine's one call (bench/gpu.py says what it checks; the README's Development section
# says how to run it). Here first, once:  bash bench/fetch-wheels.sh .whl  (the Jupyter stack the
# GPU image lacks); then on the device machine, carrying .whl:  bash bench/gpu.sh
# The CPU rehearsal, with CUDA emulated:  bash bench/gpu.sh --rehearse
#
# Whatever fails, this goes on: a package that cannot be installed for the Python found there is
# named (the sections that need it say so), every section has its own timeout, and the whole runs
# under an outer limit of 8 minutes (GPU_CHECK_LIMIT, seconds), after which results.json and
# table.md are still written and nothing is left running.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/gpu-out}
LIMIT=${GPU_CHECK_LIMIT:-470}
mkdir -p "$OUT"
PY=$(command -v python3)
echo "python: $($PY -V 2>&1) at $PY" | tee "$OUT/install.log"
if [ -d .whl ] && [ -f .whl/WANTED ]; then
  missing=()
  for pkg in $(cat .whl/WANTED); do
    if ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${pkg//-/_}') is None)" 2>/dev/null; then
      timeout 120 $PY -m pip install -q --no-index --find-links .whl --no-compile "$pkg" \
        >>"$OUT/install.log" 2>&1 || missing+=("$pkg")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu.sh: could not install for $($PY -V 2>&1): ${missing[*]} (no fitting wheel in .whl;" \
      "see $OUT/install.log): the sections that need them fail and say so" | tee -a "$OUT/install.log"
  fi
fi
if ! $PY -c "import notebook_launcher" 2>/dev/null; then  # the checkout, on every interpreter's path
  echo "$PWD" > "$($PY -c 'import site; print(site.getsitepackages()[0])')/nl-dev.pth"
fi
command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt" | head -15
timeout -s TERM -k 10 "$LIMIT" $PY bench/gpu.py --out "$OUT" --budget $((LIMIT - 25)) "$@" 2>&1 \
  | tee "$OUT/log.txt"
