#!/usr/bin/env bash
# The one prepared run for a machine with one NVIDIA GPU (about 10 minutes on an H200 with 16 cores):
#   bash launch/gpu_check.sh [CHECK ...]        (checks: tests/workers/gpu_check.py; all by default)
# 1. Within seconds, before installing anything: a GPU must be there (nvidia-smi), else it fails at once.
# 2. A venv of its own, .venv-gpu, with a CUDA torch: the system Python's own where it has one that sees the
#    GPU (a machine without a network), else torch from the package index; DeepSpeed, mpi4py and mpich from the
#    wheels in GPU_WHEELS (default .gpu-wheels, made by launch/gpu_wheels.sh where there is a network), else
#    from the index. A torch outside the tested range is named and run all the same (DS_TENSORSHARD_UNTESTED_TORCH).
# 3. DeepSpeed's ops built for CUDA (FusedAdam, DeepSpeedCPUAdam) before anything is timed.
# 4. The checks against stock ZeRO-1/2 on the same GPU; a check that fails or cannot run is a FAIL, never a
#    skip. One table: check, outcome, figure. Exit status: the number of failures (1 if the set-up failed).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
OUT="${GPU_CHECK_OUT:-$(mktemp -d)}"
say() { echo "[gpu_check $((SECONDS - START)) s] $*"; }

if ! gpus=$(timeout 20 nvidia-smi -L 2>&1) || ! grep -q "^GPU " <<<"$gpus"; then
    say "FAIL: no NVIDIA GPU here (nvidia-smi -L: ${gpus:-nothing})"; exit 1
fi
say "$(head -n 1 <<<"$gpus")"

VENV=.venv-gpu
WHEELS="${GPU_WHEELS:-.gpu-wheels}"
if [ ! -x "$VENV/bin/python" ]; then
    if python3 -c "import torch, sys; sys.exit(not (torch.version.cuda and torch.cuda.is_available()))" 2>/dev/null
    then  # the machine's CUDA torch, and its packages, also where that python3 is a venv of its own
        python3 -m venv --system-site-packages "$VENV"
        python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
            > "$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/machine_site.pth"
    else python3 -m venv "$VENV" && "$VENV/bin/pip" install -q torch || { say "FAIL: no CUDA torch"; exit 1; }
    fi
fi
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
[ -d "$WHEELS" ] && PIP+=(--no-index --find-links "$WHEELS")
"${PIP[@]}" deepspeed mpi4py mpich hjson pydantic py-cpuinfo ninja || { say "FAIL: installing DeepSpeed"; exit 1; }
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . || { say "FAIL: installing ds_tensorshard"; exit 1; }
export PATH="$PWD/$VENV/bin:$PATH" DS_ACCELERATOR=cuda TORCH_EXTENSIONS_DIR="$PWD/$VENV/torch_extensions"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - <<'EOF' || { say "FAIL: torch does not see the GPU as CUDA"; exit 1; }
import torch
assert torch.version.cuda and torch.cuda.is_available(), (torch.__version__, torch.version.cuda)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)}")
EOF
if ! python -c "from ds_tensorshard.versions import check_torch_version as c; import torch; c(torch.__version__)" \
    2>/dev/null; then
    say "torch $(python -c 'import torch; print(torch.__version__)') is outside the tested range: run all the same"
    export DS_TENSORSHARD_UNTESTED_TORCH=1
fi

# this GPU's compute capability only (DeepSpeed's builder cannot read an arch like "9.0a" from the machine's list)
TORCH_CUDA_ARCH_LIST="$(python -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
export TORCH_CUDA_ARCH_LIST
say "building DeepSpeed's ops for CUDA (arch $TORCH_CUDA_ARCH_LIST)"
python - <<'EOF' || { say "FAIL: DeepSpeed's CUDA ops do not build"; exit 1; }
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
p = [torch.nn.Parameter(torch.zeros(4, device="cuda"))]
FusedAdam(p)
DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
EOF

say "checks (logs in $OUT)"
timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-480}" python -m tests.workers.gpu_check "$OUT" "$@"
status=$?
say "done, exit status $status"
exit "$status"
