#!/usr/bin/env bash
# One call on the lent GPU machine (device tool): set up, then run the named stages, logs under $OUT.
#   bash bench/device_session.sh tests            # versions, kernel build, every CUDA test that one GPU runs
#   bash bench/device_session.sh build            # versions and kernel build only
#   bash bench/device_session.sh codecs           # bench_codecs (the default sweep) and bench_pruning
#   bash bench/device_session.sh sweep 2 4        # emulated-node collective sweeps: 2 ranks, then 4, on GPU 0
#   bash bench/device_session.sh train            # GPT-2 (MODEL=...) with 2 ranks on GPU 0 as 2 emulated nodes:
#                                                 # the shipped SpCCL config, then dense, 100 iterations each
#   bash bench/device_session.sh gpus             # one rank per GPU: all-reduce sweep as emulated nodes (n x 1, and
#                                                 # on 4+ GPUs 2 x n/2 with the hierarchical all-reduce), then NVLink
#                                                 # (with check_calls "every", then "first")
# A/B of codec builds (the working tree against packed commits, one machine): bench/ab_codecs.sh.
# TRAIN (default "spccl dense") picks the training runs; MODEL (default GPT-2 large, the largest GPT-2 of
# which two ranks fit one 80 GB GPU) overrides the model of the GPT-2 XL configs.
# Stages run in order; a failing stage is reported and the next one still runs; the exit status is
# the number of failed stages. The GPU image has torch and Triton but not this package: it is
# installed editable without dependencies (metadata only; the kernels build on first use).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/spccl-out}
mkdir -p "$OUT"
commit=${SPCCL_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export SPCCL_GIT_COMMIT=$commit
failed=0
stage() {  # stage NAME COMMAND...: run, tee to $OUT/NAME.log, count a failure
  local name=$1
  shift
  echo "=== $name: $*" | tee "$OUT/$name.log"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{
  echo "commit $commit, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} | tee "$OUT/device.txt"
# Installed once per machine: sessions started beside each other (other GPUs) share it.
python3 -c 'import importlib.metadata as m; m.version("spccl-train")' 2> /dev/null \
  || SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 100; }
sweep_grid=(--collectives all_reduce --sizes 64M,256M,1G --sparsities 90,95,99,99.9
  --methods nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct --iters 5 --iters-large 5 --warmup 1 --settle 8
  --point-budget-s 4 --no-plot --out-dir "$OUT")

while [ $# -gt 0 ]; do
  case $1 in
    build | tests)
      stage versions python3 -m spccl_train.versions
      stage build python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")'
      [ "$1" = build ] && { shift; continue; }
      stage gpu_tests python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py tests/test_pruning.py \
        tests/test_pruning_wire.py tests/test_pruning_schedule.py tests/test_optim.py tests/test_versions.py \
        tests/test_collectives_cuda.py tests/test_ddp_cuda.py
      shift
      ;;
    codecs)
      stage codecs python3 bench/bench_codecs.py --out-dir "$OUT"
      stage pruning python3 bench/bench_pruning.py --out-dir "$OUT"
      shift
      ;;
    sweep)
      shift
      while [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; do
        CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} stage "sweep_$1" torchrun --standalone --nproc-per-node="$1" \
          bench/bench_collectives.py --emulate-nodes "$1" "${sweep_grid[@]}" --time-limit-s 200
        shift
      done
      ;;
    train)
      model=${MODEL:-model.n_layer=36 model.hidden=1280 model.n_head=20}
      for mode in ${TRAIN:-spccl dense}; do
        # shellcheck disable=SC2086 # MODEL is a list of key=value overrides
        CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} NPROC=2 stage "train_$mode" launch/torchrun.sh --emulate-nodes 2 \
          "configs/gpt2_xl_$mode.yaml" $model output.dir="$OUT/runs" output.name="gpt2_$mode" output.progress=false
      done
      [ -d "$OUT/runs/gpt2_spccl" ] && [ -d "$OUT/runs/gpt2_dense" ] \
        && stage report spccl-train report "$OUT/runs/gpt2_dense" "$OUT/runs/gpt2_spccl" --out "$OUT/report.png"
      # one file for the runs' summaries, per-iteration CSVs and plots (the device returns 8 files at most)
      [ -d "$OUT/runs" ] && tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
      shift
      ;;
    gpus)
      n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      stage "sweep_gpus_${n}x1" torchrun --standalone --nproc-per-node="$n" bench/bench_collectives.py \
        --emulate-nodes "$n" "${sweep_grid[@]}" --sizes 256M,1G --dtype "${DTYPES:-fp32,bf16}" --time-limit-s 150
      if [ "$n" -ge 4 ]; then  # 2 nodes of n/2 GPUs: the hierarchical all-reduce against the flat ones
        stage "sweep_gpus_2x$((n / 2))" torchrun --standalone --nproc-per-node="$n" bench/bench_collectives.py \
          --emulate-nodes 2 "${sweep_grid[@]}" --methods "${METHODS:-nccl,auto/auto,pici/ring,pici/direct,coo/ring,coo/direct},pici/hierarchical,coo/hierarchical" \
          --sizes 256M,1G --dtype "${DTYPES:-fp32,bf16}" --time-limit-s 200
      fi
      stage "sweep_gpus_nvlink" torchrun --standalone --nproc-per-node="$n" bench/bench_collectives.py \
        "${sweep_grid[@]}" --sizes 256M,1G --dtype "${DTYPES:-fp32,bf16}" --time-limit-s 100
      # the same with check_calls="first": auto holds a shape NCCL clearly wins, with no exchange
      stage "sweep_gpus_nvlink_first" torchrun --standalone --nproc-per-node="$n" bench/bench_collectives.py \
        "${sweep_grid[@]}" --sizes 256M,1G --dtype "${DTYPES:-fp32,bf16}" --check-calls first --time-limit-s 100
      shift
      ;;
    *)
      echo "unknown stage $1" >&2
      exit 101
      ;;
  esac
done
exit "$failed"
