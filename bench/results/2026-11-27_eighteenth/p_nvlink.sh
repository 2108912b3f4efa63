#!/bin/bash
# device (2+ GPUs, one rank per GPU over NVLink): this tree's all-reduce sweep of bench_collectives.py
# (256 MiB and 1 GiB, fp32 and bf16, 90-99.9%, ITERS (default 5) timed calls in turns), checking every call,
# then holding native calls (check_calls "first"). Tables to $OUT/nvlink_<mode>.log, CSVs beside them.
# LIMIT: each sweep's --time-limit-s (default 200).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
grid=(--collectives all_reduce --sizes 256M,1G --sparsities 90,95,99,99.9 --dtype fp32,bf16
  --methods nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct --iters ${ITERS:-5} --iters-large ${ITERS:-5} --warmup 1 --settle 8
  --point-budget-s 4 --no-plot --time-limit-s ${LIMIT:-200})
for mode in ${MODES:-every first}; do
  timeout $(( ${LIMIT:-200} + 60 )) torchrun --standalone --nproc-per-node=$n bench/bench_collectives.py \
    "${grid[@]}" --check-calls $mode --out-dir /tmp/nv_$mode > $OUT/nvlink_$mode.log 2>&1
  echo "$n GPUs, check_calls $mode: $(grep -E 'within 10%|fastest timed' $OUT/nvlink_$mode.log | cut -c1-220)"
  cp "$(ls -t /tmp/nv_$mode/*.csv | head -1)" $OUT/nvlink_$mode.csv
done
