#!/usr/bin/env bash
# Where there is a network: the wheels launch/gpu_check.sh installs on a GPU machine that has none (CPython 3.12,
# x86-64, its own CUDA torch), into .gpu-wheels (about 20 MB): DeepSpeed (DEEPSPEED_VERSION, default the newest
# release tested, built here from its sdist without ops: they are built on the GPU machine) and what it and the
# mpi transport need beyond such a machine's image.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu-wheels
rm -rf "$DEST" && mkdir -p "$DEST"
export PIP_CONFIG_FILE=/dev/null DS_BUILD_OPS=0
python3 -m pip wheel -q --no-deps -w "$DEST" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
for package in hjson pydantic pydantic-core annotated-types typing-inspection mpi4py mpich py-cpuinfo ninja msgpack einops; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORM[@]}" -d "$DEST" "$package"
done
du -sh "$DEST"
