#!/usr/bin/env bash
# Fetch (here, where pip reaches PyPI) the wheels the GPU machine's image lacks for bench/gpu.sh:
# the Jupyter stack the lessons and the kernel tests need, nbval, jupytext, parameterized. The image
# has torch, accelerate, transformers, numpy, tqdm, safetensors, cloudpickle, pytest, pytest-xdist
# and pytest-timeout (/work/.library/device/KINDS.md lists it); nothing can be fetched there.
#
# Usage, from the project's root:  bash bench/fetch-wheels.sh [.whl]
#
# Compiled wheels (pyzmq, tornado, rpds-py, debugpy, ...) are fetched for CPython 3.10 to 3.13,
# since which Python the machine has can change; bench/gpu.sh installs what fits the Python it
# finds there and says what could not be installed.
set -uo pipefail
D=${1:-.whl}
mkdir -p "$D"
grep -qx "/$D/" .git/info/exclude 2>/dev/null || echo "/$D/" >> .git/info/exclude
WANTED=(ipykernel ipywidgets nbformat nbclient jupyter_client nbval jupytext parameterized)
for version in 3.10 3.11 3.12 3.13; do
  python3 -m pip download -q --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$D" "${WANTED[@]}" > "$D/.log" 2>&1 \
    || { grep -v "is ignored" "$D/.log" | tail -5; echo "fetch-wheels: CPython $version: not all fetched" >&2; }
done
# The image has these already (two versions of one package would make pip there choose; keep theirs)
( cd "$D" && rm -f attrs-* certifi-* charset_normalizer-* coverage-* idna-* iniconfig-* jinja2-* \
  markupsafe-* MarkupSafe-* packaging-* pluggy-* psutil-* pygments-* pytest-[0-9]* \
  python_dateutil-* pyyaml-* PyYAML-* requests-* six-* typing_extensions-* urllib3-* numpy-* \
  torch-* tqdm-* cloudpickle-* )
rm -f "$D/.log"
echo "${WANTED[*]}" > "$D/WANTED"
du -sh "$D"
