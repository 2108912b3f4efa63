#!/bin/bash
# device (2 GPUs): heldprof.py on a base tree (.ab/head.tar, carried) and this tree, alternated
# ROUNDS times (HP_DTYPES: fp32 bf16), then this tree's NVLink sweep holding native calls
# (p_nvlink.sh with MODES=first). Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
new=$PWD
here=$new/bench/results/2026-11-27_eighteenth
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .ab/head.tar -C /tmp/base
(cd /tmp/base && PYTHONPATH=/tmp/base SPCCL_EXT_DIR=/tmp/ext_base MAX_JOBS=8 python3 -c 'from spccl_train._ext import load_kernels; load_kernels()') > $OUT/build_base.log 2>&1 &
(SPCCL_EXT_DIR=/tmp/ext_new MAX_JOBS=8 python3 -c 'from spccl_train._ext import load_kernels; load_kernels()') > $OUT/build_new.log 2>&1 &
wait
for round in $(seq ${ROUNDS:-2}); do
  for dtype in ${HP_DTYPES:-fp32}; do
    for tree in base new; do
      if [ $tree = base ]; then dir=/tmp/base; else dir=$new; fi
      echo "=== $tree $dtype round $round" | tee -a $OUT/held.log
      (cd $dir && PYTHONPATH=$dir SPCCL_EXT_DIR=/tmp/ext_$tree HP_DTYPE=$dtype timeout 120 torchrun --standalone \
        --nproc-per-node=2 $here/heldprof.py 2>&1 | grep -v "^W1127\|OMP_NUM" | tail -12) | tee -a $OUT/held.log
    done
  done
done
SPCCL_EXT_DIR=/tmp/ext_new MODES=first bash $here/p_nvlink.sh
