#!/usr/bin/env bash
# Train a small GPT on 2 local CPU ranks with the deepspeed launcher and ds_tensorshard, then print the
# loss curve's start and end and each rank's optimizer-state bytes next to stock ZeRO-2's.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/free_port.sh
source launch/process_group.sh
run_group deepspeed --num_gpus "${RANKS:-2}" --master_port "$PORT" --module ds_tensorshard.examples.train_gpt \
    --deepspeed_config "${CONFIG:-configs/tensorshard_fp32.json}" --steps "${STEPS:-40}"
