#!/usr/bin/env bash
# Run an unmodified training script on N MPI ranks with the plugin registered:
#   bash launch/mpiexec.sh N SCRIPT [ARGS...]            (this host)
#   HOSTFILE=launch/hosts.mpich bash launch/mpiexec.sh N SCRIPT [ARGS...]   (hydra format: NAME:N)
# Ranks are discovered by deepspeed.init_distributed through mpi4py; either comm_backend works.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: [HOSTFILE=F] bash launch/mpiexec.sh N SCRIPT [ARGS...]" >&2; exit 2; fi
ranks="$1"; shift
cd "$(dirname "$0")/.."
source launch/setup_env.sh
hosts=()
if [ -n "${HOSTFILE:-}" ]; then hosts=(-f "$HOSTFILE"); fi
source launch/process_group.sh
run_group mpiexec "${hosts[@]}" -n "$ranks" python -m ds_tensorshard "$@"
