#!/bin/bash
# device (2 GPUs): base tree (.ab/base.tar) against the working tree, alternated; stage stamps
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || cat $OUT/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .ab/base.tar -C /tmp/base
for r in 1 2; do
  for tree in base new; do
    pp=$([ $tree = base ] && echo /tmp/base || echo $PWD)
    for spec in ${SPECS:-fp32:99 bf16:90}; do
      IFS=: read dt sp <<< "$spec"
      echo "== round $r $tree $dt $sp"
      PYTHONPATH=$pp CP_DTYPE=$dt CP_SPARSITY=$sp CP_PROF=none CP_METHODS=${METHODS:-nccl,pici/direct,coo/direct,auto/every,auto/first} CP_ROUNDS=${ROUNDS:-30} \
        torchrun --standalone --nproc-per-node=2 .ab/callprof.py > $OUT/ab_${r}_${tree}_${dt}_${sp}.log 2>&1; grep median $OUT/ab_${r}_${tree}_${dt}_${sp}.log
    done
  done
done
[ -n "${STAMPS:-}" ] && for tree in base new; do
  pp=$([ $tree = base ] && echo /tmp/base || echo $PWD)
  echo "== stamps $tree"
  PYTHONPATH=$pp ST_BYTES=268435456 ST_CALLS=40 torchrun --standalone --nproc-per-node=2 .ab/stamps.py 2>&1 | grep -v "^W\|\*\*\*"
done
