#!/bin/bash
# device (2 GPUs over NVLink): heldstage.py (fp32, 256 MiB, HS_CALLS calls per method), then the NVLink all-reduce
# sweep of bench_collectives.py holding native calls (check_calls "first"), as the eighteenth sitting's
# p_nvlink.sh, with --trace: $OUT/heldstage_fp32.log, nvlink_first.{log,csv}, nvlink_first_trace.csv.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "${HELDSTAGE:-1}" = 1 ]; then
  HS_DTYPE=fp32 HS_CALLS=${HS_CALLS:-200} timeout 200 torchrun --standalone --nproc-per-node=2 \
    bench/results/2026-11-27_twentysecond/heldstage.py > $OUT/heldstage_fp32.log 2>&1
  grep -v '^W11' $OUT/heldstage_fp32.log | tail -22
fi
grid=(--collectives all_reduce --sizes 256M,1G --sparsities 90,95,99,99.9 --dtype fp32,bf16
  --methods nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct --iters ${ITERS:-15} --iters-large ${ITERS:-15}
  --warmup 1 --settle 8 --point-budget-s 4 --no-plot --time-limit-s ${LIMIT:-200} --trace)
timeout $(( ${LIMIT:-200} + 60 )) torchrun --standalone --nproc-per-node=$n bench/bench_collectives.py \
  "${grid[@]}" --check-calls first --out-dir /tmp/nv_first > $OUT/nvlink_first.log 2>&1
grep -E 'within 10%|fastest timed|of the .* beyond|^    [0-9]' $OUT/nvlink_first.log | cut -c1-240
cp "$(ls -t /tmp/nv_first/*_trace.csv | head -1)" $OUT/nvlink_first_trace.csv
cp "$(ls -t /tmp/nv_first/*.csv | grep -v _trace | head -1)" $OUT/nvlink_first.csv
