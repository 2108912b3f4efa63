#!/bin/bash
# device (2 GPUs): install, build, callprof, then the NVLink sweeps (every, first)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export SPCCL_GIT_COMMIT=${COMMIT:-work}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || cat $OUT/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
if [ -n "${PROF:-}" ]; then
  CP_DTYPE=fp32 CP_SPARSITY=99 CP_PROF=pici/direct CP_METHODS=nccl,pici/direct,coo/direct,auto/every,auto/first CP_OUT=$OUT CP_ROUNDS=20 \
    torchrun --standalone --nproc-per-node=2 .ab/callprof.py > $OUT/prof.log 2>&1
  grep -E "median" $OUT/prof.log
fi
grid=(--collectives all_reduce --sizes 256M,1G --sparsities 90,95,99,99.9
  --methods nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct --iters 5 --iters-large 3 --warmup 1 --settle 8
  --point-budget-s 4 --no-plot --dtype fp32,bf16)
for mode in ${MODES:-every first}; do
  mkdir -p $OUT/nv_$mode
  torchrun --standalone --nproc-per-node=2 bench/bench_collectives.py "${grid[@]}" --check-calls $mode --out-dir $OUT/nv_$mode --time-limit-s 100 > $OUT/nv_$mode.log 2>&1
  grep -E "within 10%|^AR.*auto" $OUT/nv_$mode.log | cut -c1-140
done
