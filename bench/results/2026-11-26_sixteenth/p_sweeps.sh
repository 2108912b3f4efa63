#!/bin/bash
# device (1 GPU): this tree's emulated-node sweeps (2 and 4 ranks), ROUNDS times, then auto's calls
# at 4 ranks, 256 MiB at 99% (probe_trace.py). Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
here=bench/results/2026-11-26_sixteenth
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || cat $OUT/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
grid=(--collectives all_reduce --sizes 64M,256M,1G --sparsities 90,95,99,99.9
  --methods nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct --iters 5 --iters-large 3 --warmup 1 --settle 8
  --point-budget-s 4 --no-plot --time-limit-s 200)
for round in $(seq ${ROUNDS:-2}); do
  for w in ${WORLDS:-2 4}; do
    mkdir -p $OUT/sw_${w}_$round
    CUDA_VISIBLE_DEVICES=0 timeout 240 torchrun --standalone --nproc-per-node=$w bench/bench_collectives.py \
      --emulate-nodes $w "${grid[@]}" --out-dir $OUT/sw_${w}_$round > $OUT/sw_${w}_$round.log 2>&1
    echo "round $round, $w ranks: $(grep 'within 10%' $OUT/sw_${w}_$round.log | cut -c1-220)"
  done
done
PT_TAG=trace PT_PROBES=1 PT_POINTS=256M:99 PT_FIXED=pici/direct,coo/direct CUDA_VISIBLE_DEVICES=0 timeout 120 \
  torchrun --standalone --nproc-per-node=4 $here/probe_trace.py 2>&1 | grep -v "^W11\|^\*\*\*\|OMP_NUM" > $OUT/trace.log
grep "^\[trace\]" $OUT/trace.log | cut -c1-300
