# Environment defaults for spccl-train launches (sourced by torchrun.sh and slurm.sbatch).
# NVLink SHARP multicast stays off: the project's GPU machines forbid it, and SpCCL's
# point-to-point transport gains nothing from it.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
# No model or dataset hub: tokenizers and data come from local files.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
# DDP's gradient hooks and NCCL: report async errors instead of hanging.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONUNBUFFERED=1
