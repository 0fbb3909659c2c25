#!/usr/bin/env bash
# Run any training script on N local ranks with the deepspeed launcher and the plugin registered,
# without changing the script:  bash launch/local.sh N SCRIPT [ARGS...]
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: bash launch/local.sh N SCRIPT [ARGS...]" >&2; exit 2; fi
ranks="$1"; shift
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/free_port.sh
source launch/process_group.sh
run_group deepspeed --num_gpus "$ranks" --master_port "$PORT" --module ds_tensorshard "$@"
