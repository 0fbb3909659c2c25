#!/usr/bin/env bash
# The deepspeed launcher with an MPI runner:  bash launch/deepspeed_mpi.sh HOSTFILE SCRIPT [ARGS...]
# LAUNCHER=mpich (default) | openmpi | impi.  On one host, or without passwordless ssh, DeepSpeed needs
# --force_multi (else a single-host hostfile silently uses the local launcher), --no_ssh_check and an
# explicit --master_addr; set MULTI_HOST=1 on a real cluster to drop those.
# DeepSpeed 0.19.8's MPI runners mishandle --module, so ds_tensorshard's runner is passed as a script path.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: bash launch/deepspeed_mpi.sh HOSTFILE SCRIPT [ARGS...]" >&2; exit 2; fi
hostfile="$1"; shift
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/free_port.sh
runner="$(python -c 'import ds_tensorshard.__main__ as m; print(m.__file__)')"
flags=(--hostfile "$hostfile" --launcher "${LAUNCHER:-mpich}" --master_port "$PORT")
if [ -z "${MULTI_HOST:-}" ]; then flags+=(--force_multi --no_ssh_check --master_addr "${MASTER_ADDR:-127.0.0.1}"); fi
source launch/process_group.sh
run_group deepspeed "${flags[@]}" "$runner" "$@"
