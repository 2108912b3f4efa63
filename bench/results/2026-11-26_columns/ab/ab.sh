#!/usr/bin/env bash
# A/B on one GPU, 2 ranks as 2 emulated nodes: c845405 (old/, before plans became columns) against the working tree, eager and graphed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
root=$PWD
python3 -c 'import importlib.metadata as m; m.version("spccl-train")' 2>/dev/null \
  || SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt"
grid=(--collectives all_reduce --sizes 64M,256M,1G --sparsities 99,99.9 --methods nccl,auto/auto,pici/direct,coo/direct,coo/ring
  --iters 5 --iters-large 3 --warmup 1 --settle 6 --point-budget-s 4 --no-plot --emulate-nodes 2 --time-limit-s 90)
for mode in ${MODES:-eager graphs}; do
  graphs=""; [ "$mode" = graphs ] && graphs=--cuda-graphs
  for v in ${ORDER:-new old}; do
    dir=$root; commit=$NEW; [ "$v" = old ] && { dir=$root/old; commit=c845405; }
    name=${v}${graphs:+_graphs}${TAG:-}
    mkdir -p "$OUT/$name"
    (cd "$dir" && PYTHONPATH=$dir SPCCL_GIT_COMMIT=$commit CUDA_VISIBLE_DEVICES=0 timeout 110 torchrun --standalone \
      --nproc-per-node=2 bench/bench_collectives.py "${grid[@]}" $graphs --out-dir "$OUT/$name") > "$OUT/$name.log" 2>&1
    echo "$name: exit $?; $(grep -c ' ok$' "$OUT/$name.log") points ok"
  done
done
