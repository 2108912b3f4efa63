#!/bin/bash
# device (2 GPUs, NVLink): autoprof.py (auto against its fixed candidates, check_calls "first") at
# 1 GiB bf16 for each of AP_SPARSITIES (default 99.9 99), with a torch.profiler table each; then
# this tree's NVLink sweep holding native calls (p_nvlink.sh, MODES=first) unless SWEEP=0. Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
here=bench/results/2026-11-27_nineteenth
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
MAX_JOBS=16 python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
for s in ${AP_SPARSITIES:-99.9 99}; do
  AP_SPARSITY=$s AP_PROF=1 timeout 150 torchrun --standalone --nproc-per-node=2 $here/autoprof.py 2>&1 \
    | grep -v "^W11\|OMP_NUM\|USDT\|\*\*\*\*" > $OUT/autoprof_$s.log
  head -n 40 $OUT/autoprof_$s.log
done
if [ "${SWEEP:-1}" = 1 ]; then MODES=first bash bench/results/2026-11-27_eighteenth/p_nvlink.sh; fi
