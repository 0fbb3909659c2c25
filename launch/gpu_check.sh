#!/usr/bin/env bash
# What one NVIDIA GPU can check, each check within 240 s; one line per check, exit status = number of failures.
#   bash launch/gpu_check.sh
# 1. cuda_equivalence_1rank: stock ZeRO-1/2 vs ds_tensorshard on CUDA at one rank (NCCL, CUDA FusedAdam),
#    fp32, bf16 and fp16 (tests/multiprocess/test_gpu.py).
# 2. mpi_2ranks_1gpu: two ranks sharing the GPU (gloo for torch.distributed, since NCCL refuses two ranks
#    on one device) with comm_backend "mpi": CUDA tensors go through pinned host memory, or directly when
#    mpi4py reports a CUDA-aware MPI (the line says which); checked against stock ZeRO-2 on the CPU.
# 3. checkpoint_resume_cuda: save at step 3 and resume on CUDA equals the uninterrupted run.
# 4. fused_lamb_lion: DeepSpeed's FusedLamb (whole-matrix: against stage 0) and FusedLion (element-wise:
#    against stock ZeRO-2) as ds_tensorshard's inner optimizers.
# 5. zero_offload_cuda: offload_optimizer cpu with pin_memory on CUDA at one rank: owned masters pinned in host
#    memory, DeepSpeedCPUAdam on them, against stock ZeRO-Offload (fp32 stage 2, bf16 stage 1). The copies are
#    blocking (no non-blocking copies or side streams yet), so there is no stream order to check.
# 6. bench_gpt_1gpu, bench_lora_1gpu: `ds-tensorshard bench --ranks 1` on CUDA (NCCL) with stock ZeRO-2, PyTorch
#    FSDP2 in its ZeRO-2 form (fully_shard per block and root, reshard_after_forward=False) and ds_tensorshard
#    (torch transport), on the 85.9M-parameter GPT and on the LoRA-like model (2,000 adapter tensors: host time);
#    the line gives the step times and ratios, the first losses checked against stock's. One GPU is one rank:
#    nothing crosses a wire; more ranks need one GPU each (--ranks N).
# 7. stripes_nccl_1rank: "bucket_layout": "stripes", one NCCL reduce_scatter_tensor and all_gather_into_tensor per
#    bucket, against stock ZeRO-1/2 (fp32 stage 2, bf16 stage 1) at one rank. Grouping a window's per-owner
#    reduces in one NCCL group call is not built: stripes are the one-launch-per-bucket path.
set -uo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC:-torch}" source launch/setup_env.sh >/dev/null
export DS_ACCELERATOR=cuda
LOGS="${LOGS:-$(mktemp -d)}"
failures=0

check() {  # check NAME COMMAND...: run with a deadline, print one line
    local name=$1; shift
    if timeout --kill-after=10 240 "$@" >"$LOGS/$name.log" 2>&1; then
        echo "PASS $name $(tail -n 1 "$LOGS/$name.log" | grep '^NOTE' | cut -c6-)"
    else
        echo "FAIL $name (log: $LOGS/$name.log)"; failures=$((failures + 1))
    fi
}

check cuda_equivalence_1rank python -m pytest -q -p no:cacheprovider -m gpu tests/multiprocess/test_gpu.py
check mpi_2ranks_1gpu python -m tests.workers.gpu_check mpi "$LOGS/mpi"
check checkpoint_resume_cuda python -m tests.workers.gpu_check checkpoint "$LOGS/ckpt"
check fused_lamb_lion python -m tests.workers.gpu_check fused "$LOGS/fused"
check zero_offload_cuda python -m tests.workers.gpu_check offload "$LOGS/offload"
check stripes_nccl_1rank python -m tests.workers.gpu_check stripes "$LOGS/stripes"
check bench_gpt_1gpu python -m tests.workers.gpu_check bench-gpt "$LOGS/bench_gpt"
check bench_lora_1gpu python -m tests.workers.gpu_check bench-lora "$LOGS/bench_lora"
exit "$failures"
