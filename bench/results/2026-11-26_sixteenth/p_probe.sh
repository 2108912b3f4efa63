#!/bin/bash
# device (1 GPU): the probe's repeatability and auto's calls, base (.ab/base.tar) and this tree
# alternated; then this tree's emulated sweeps (2 and 4 ranks). Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
here=bench/results/2026-11-26_sixteenth
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || cat $OUT/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .ab/base.tar -C /tmp/base
run() {  # run TREE WORLD TAG [env...]
  local tree=$1 w=$2 tag=$3; shift 3
  local pp=$([ $tree = base ] && echo /tmp/base || echo $PWD)
  env "$@" PT_TAG=$tag PYTHONPATH=$pp CUDA_VISIBLE_DEVICES=0 timeout 150 torchrun --standalone --nproc-per-node=$w \
    $here/probe_trace.py 2>&1 | grep -v "^W11\|^\*\*\*\|OMP_NUM" >> $OUT/probe.log
}
for round in 1 2; do
  for tree in base new; do
    run $tree 2 $tree-2r-$round PT_PROBES=5 PT_POINTS=$([ $round = 1 ] && echo 1G:90,256M:90 || echo "")
    run $tree 4 $tree-4r-$round PT_PROBES=4 PT_POINTS=""
  done
done
grep "probe" $OUT/probe.log | sed 's/; exchange.*//'
grid=(--collectives all_reduce --sizes 64M,256M,1G --sparsities 90,95,99,99.9
  --methods nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct --iters 5 --iters-large 3 --warmup 1 --settle 8
  --point-budget-s 4 --no-plot --time-limit-s 200)
for w in ${WORLDS:-2 4}; do
  mkdir -p $OUT/sw_new_$w
  SPCCL_GIT_COMMIT=${SPCCL_GIT_COMMIT:-new} CUDA_VISIBLE_DEVICES=0 timeout 240 torchrun --standalone --nproc-per-node=$w bench/bench_collectives.py \
    --emulate-nodes $w "${grid[@]}" --out-dir $OUT/sw_new_$w > $OUT/sw_new_$w.log 2>&1
  echo "new $w: $(grep 'within 10%' $OUT/sw_new_$w.log | cut -c1-200)"
done
