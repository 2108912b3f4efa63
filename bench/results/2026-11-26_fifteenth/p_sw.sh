#!/bin/bash
# device (1 GPU): emulated-node sweeps, trees alternated (TREES order; base = .ab/base.tar)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || cat $OUT/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .ab/base.tar -C /tmp/base
grid=(--collectives all_reduce --sizes 64M,256M,1G --sparsities 90,95,99,99.9
  --methods nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct --iters 5 --iters-large 3 --warmup 1 --settle 8
  --point-budget-s 4 --no-plot --time-limit-s 200)
for tree in ${TREES:-new base}; do
  pp=$([ $tree = base ] && echo /tmp/base || echo $PWD)
  for w in ${WORLDS:-2 4}; do
    mkdir -p $OUT/sw_${tree}_$w
    PYTHONPATH=$pp SPCCL_GIT_COMMIT=$tree CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc-per-node=$w $pp/bench/bench_collectives.py \
      --emulate-nodes $w "${grid[@]}" --out-dir $OUT/sw_${tree}_$w > $OUT/sw_${tree}_$w.log 2>&1
    echo "$tree $w: $(grep 'within 10%' $OUT/sw_${tree}_$w.log | cut -c1-200)"
  done
done
