#!/bin/bash
# device (2 GPUs over NVLink): heldstage.py for fp32 and bf16 at 256 MiB, HS_CALLS (default 200) calls
# per method; logs to $OUT/heldstage_<dtype>.log
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
for dt in ${DTYPES:-fp32 bf16}; do
  HS_DTYPE=$dt HS_CALLS=${HS_CALLS:-200} timeout 200 torchrun --standalone --nproc-per-node=2 \
    bench/results/2026-11-27_twentysecond/heldstage.py > $OUT/heldstage_$dt.log 2>&1
  grep -v '^W11' $OUT/heldstage_$dt.log | tail -22
done
