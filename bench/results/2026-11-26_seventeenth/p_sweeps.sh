#!/bin/bash
# device (1 GPU): this tree's emulated-node sweeps of bench_collectives.py (all-reduce, 64 MiB-1 GiB,
# 90-99.9%, fp32; 2 and 4 ranks on GPU 0, each its own node), ROUNDS times. Each sweep's table goes
# to $OUT/sw_<ranks>_<round>.log; CSV=1 returns each sweep's CSV too (the device returns at most 8 files).
# ITERS_LARGE (timed calls at >= 256 MiB, default 3), LIMIT (each sweep's --time-limit-s, default 200).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
grid=(--collectives all_reduce --sizes 64M,256M,1G --sparsities 90,95,99,99.9
  --methods nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct --iters 5 --iters-large ${ITERS_LARGE:-3} --warmup 1 --settle 8
  --point-budget-s 4 --no-plot --time-limit-s ${LIMIT:-200})
for round in $(seq ${ROUNDS:-1}); do
  for w in ${WORLDS:-2 4}; do
    CUDA_VISIBLE_DEVICES=0 timeout $(( ${LIMIT:-200} + 40 )) torchrun --standalone --nproc-per-node=$w bench/bench_collectives.py \
      --emulate-nodes $w "${grid[@]}" --out-dir /tmp/sw_${w}_$round > $OUT/sw_${w}_$round.log 2>&1
    echo "round $round, $w ranks: $(grep -E 'within 10%|fastest timed' $OUT/sw_${w}_$round.log | cut -c1-220)"
    if [ "${CSV:-0}" = 1 ]; then cp "$(ls -t /tmp/sw_${w}_$round/*.csv | head -1)" $OUT/sw_${w}_$round.csv; fi
  done
done
