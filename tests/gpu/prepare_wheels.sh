#!/usr/bin/env bash
# Wheels a lent GPU machine lacks, for the GPU tier (tests/gpu/README.md says how they travel).
#
# That machine (python3 3.12, torch 2.11 CUDA, transformers 5.17, no network) has no DeepSpeed
# and no pydantic. This fetches them and what they need beyond its image into .whl/ (ignored by
# git), at the versions constraints*.txt pins, then checks the set: it installs with
# --no-index --no-deps into a scratch folder, and every Requires-Dist of every wheel (markers read
# for CPython 3.12 on Linux) must be met by a carried wheel or named in IMAGE below.
#
# Usage (from anywhere in the repository):  PYTHON=/path/to/python tests/gpu/prepare_wheels.sh
# PYTHON builds DeepSpeed's wheel (it publishes only a source archive) and should have torch:
# DeepSpeed records the torch it was built beside; a python with torch 2.11 (CUDA 13) matches the
# GPU machine. Without torch the wheel still builds (ops are never precompiled here: DS_BUILD_OPS=0).
set -euo pipefail

ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$ROOT"
PY=${PYTHON:-python3}
DEST=${WHEELS:-.whl}
# Packages the GPU machine's image holds (/work/.library/device/KINDS.md): needs met by them are not carried.
IMAGE="torch numpy packaging psutil py-cpuinfo msgpack ninja einops tqdm filelock fsspec jinja2 sympy networkx
setuptools triton safetensors transformers huggingface-hub tokenizers pyyaml regex matplotlib pytest hypothesis"

pin() {  # the exact version constraints*.txt pins for $1
    local line
    line=$(grep -ihE "^$1==" constraints.txt constraints-torch.txt | head -n1)
    [[ -n $line ]] || { echo "prepare_wheels: $1 is not pinned in constraints*.txt" >&2; exit 1; }
    echo "${line#*==}"
}

rm -rf "$DEST"
mkdir -p "$DEST"

# DeepSpeed: a pure-Python wheel from the sdist, built beside PYTHON's torch.
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$(pin deepspeed)"

# The rest as published wheels for CPython 3.12 on manylinux x86-64 (pydantic-core is compiled).
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DEST" \
    "pydantic==$(pin pydantic)" "pydantic_core==$(pin pydantic_core)" "annotated-types==$(pin annotated-types)" \
    "typing-inspection==$(pin typing-inspection)" "hjson==$(pin hjson)" \
    "typing_extensions==$(pin typing_extensions)"  # pydantic-core needs a newer one than torch's floor

CHECK=$(mktemp -d)
trap 'rm -rf "$CHECK"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$CHECK/site" "$DEST"/*.whl
"$PY" "$ROOT/tests/gpu/check_wheels.py" "$DEST" $IMAGE
du -ch "$DEST"/*.whl | tail -n1
