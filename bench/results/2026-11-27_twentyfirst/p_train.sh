#!/bin/bash
# device (one H200): GPT-2 XL with 2 ranks on GPU 0 as 2 emulated nodes, the shipped SpCCL config
# for its 100 iterations, and dense for DENSE_ITERS (default 30; 20 summarised): the dense path
# has not changed since the full pair at d7abd35 (bench/results/2026-11-27_nineteenth/), so its
# iteration time is measured again on this machine and its loss curve compared with that run's.
# Logs and a tarball of the runs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
run() {  # run NAME CONFIG OVERRIDES...
  local name=$1 config=$2
  shift 2
  local start=$SECONDS
  CUDA_VISIBLE_DEVICES=0 NPROC=2 launch/torchrun.sh --emulate-nodes 2 "configs/$config" model.n_layer=48 "$@" \
    output.dir="$OUT/runs" output.name="gpt2_$name" output.progress=false > "$OUT/train_$name.log" 2>&1
  echo "=== train_$name: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/train_$name.log"
}
run spccl gpt2_xl_spccl.yaml
d=${DENSE_ITERS:-30}
run dense gpt2_xl_dense.yaml train.iterations="$d" train.warmup_iterations=$((d / 3))
tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
