# Sourced by the launch scripts: make (once) and activate the project's venv, then set CPU defaults.
# VENV: where the venv lives (default .venv); TORCH_SPEC: the torch to install (default the CPU build
# torch==2.13.0; on a CUDA machine set e.g. TORCH_SPEC=torch).
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
stamp="$VENV/.ds_tensorshard-installed"
want="$(cat setup.cfg pyproject.toml launch/setup_env.sh | sha1sum | cut -d" " -f1) $TORCH_SPEC"
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    python3 -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing $TORCH_SPEC, deepspeed and ds_tensorshard into $VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "$TORCH_SPEC"
    "$VENV/bin/pip" install -q -e ".[test,mpich,bench,lint]"
    echo "$want" > "$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# JIT-built ops (FusedAdam, the shm comm op) in this venv's own cache: another venv never rebuilds them
# under our feet, and a build lock left by a killed process stays ours (ds-tensorshard report names it)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/$VENV/torch_extensions}"
# DeepSpeed JIT-builds its ops on first use, about a minute each on 2 cores: FusedAdam, DeepSpeedCPUAdam (for
# ZeRO-Offload) and, on the CPU accelerator, the shared-memory all-reduce that every deepspeed.init_distributed
# loads. Build them once, up front: the tests (the fast tier included) then build none of them. Importing
# ds_tensorshard first removes the lock of a build that was stopped midway (ds_tensorshard/build_locks.py), on
# which the build would otherwise wait forever. Shown: a removal, and the last two other lines but warnings.
python -c "import torch, ds_tensorshard; from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
p = [torch.nn.Parameter(torch.zeros(1))]; FusedAdam(p); DeepSpeedCPUAdam(p)
from deepspeed.comm.torch import build_shm_op; build_shm_op()" 2>&1 | awk 'tolower($0) ~ /warn/ {next}
    /removed the build lock/ {print; next} {last[++n % 2] = $0}
    END {if (n > 1) print last[(n - 1) % 2]; if (n) print last[n % 2]}' || true
