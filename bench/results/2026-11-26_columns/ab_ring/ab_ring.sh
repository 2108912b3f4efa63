#!/usr/bin/env bash
# Focused A/B: eager coo/ring all-reduce, 256M and 1G at 99%, 2 ranks as 2 emulated nodes, c845405 vs the tree.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
root=$PWD
python3 -c 'import importlib.metadata as m; m.version("spccl-train")' 2>/dev/null \
  || SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
grid=(--collectives all_reduce --sizes 256M,1G --sparsities 99 --methods nccl,coo/ring,pici/ring --iters 15 --iters-large 15
  --warmup 2 --no-plot --emulate-nodes 2 --time-limit-s 60)
for v in old new old new; do
  dir=$root; commit=$NEW; [ "$v" = old ] && { dir=$root/old; commit=c845405; }
  n=$((${n:-0} + 1)); name=${v}_$n; mkdir -p "$OUT/$name"
  (cd "$dir" && PYTHONPATH=$dir SPCCL_GIT_COMMIT=$commit CUDA_VISIBLE_DEVICES=0 timeout 70 torchrun --standalone \
    --nproc-per-node=2 bench/bench_collectives.py "${grid[@]}" --out-dir "$OUT/$name") > "$OUT/$name.log" 2>&1
  echo "$name: $(grep -E 'coo/ring|pici/ring' "$OUT/$name.log" | awk '{print $2, $6, $7}' | tr '\n' ' ')"
done
