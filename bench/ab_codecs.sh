#!/usr/bin/env bash
# A/B of codec builds on the GPU machine (device tool): the working tree ("new") against other trees,
# each built into its own extension directory and timed back to back in one call, so that every
# figure compares on one machine (the way bench/results/2026-11-26_codecs/ was made).
#
# Here, pack the trees to compare into .ab/ (git-ignored; it travels with the run tool's `carry`):
#   mkdir -p .ab && git archive HEAD~1 -o .ab/base.tar           # a commit
#   git archive "$(git stash create)" -o .ab/wip.tar             # the uncommitted tree (clean tree: HEAD)
# There (run tool, carry [".ab"]):
#   TREES="base" bash bench/ab_codecs.sh                         # new against base
#   TREES="base wip" ROUNDS=1 PRUNING=0 bash bench/ab_codecs.sh tests
# Environment: TREES (tarball names in .ab/, default "base"); CODEC_ARGS (bench_codecs.py's grid,
# default 1 GiB, fp32 and bf16, 50-99.9%); ROUNDS (default 2: every tree once per round, in order);
# PRUNING=0 skips bench_pruning.py (run once per tree, in round 1; PRUNING=every: in every round).
# "tests": the kernel tests on the working tree's build afterwards. Writes $OUT/ab.tgz (every log
# and CSV) and $OUT/summary.log (the Pici and COO rows and the pruning tables of every tree and
# round). The trees build in parallel (about 15 s on 16 cores); a 1 GiB grid takes about 15 s per
# tree and round.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ab-out}
mkdir -p "$OUT/ab"
new=$PWD
log="$OUT/ab/summary.log"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} | tee "$log"
python3 -c 'import importlib.metadata as m; m.version("spccl-train")' 2> /dev/null \
  || SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/ab/install.log" 2>&1
trees="${TREES:-base} new"
dir_of() { if [ "$1" = new ]; then echo "$new"; else echo "/tmp/ab_tree_$1"; fi; }
for t in $trees; do
  if [ "$t" != new ] && [ ! -f ".ab/$t.tar" ]; then
    echo "no .ab/$t.tar: pack it here first (git archive REV -o .ab/$t.tar) and carry .ab" | tee -a "$log"
    exit 2
  fi
done
start=$SECONDS
for t in $trees; do
  d=$(dir_of "$t")
  if [ "$t" != new ]; then
    rm -rf "$d"
    mkdir -p "$d"
    tar -xf ".ab/$t.tar" -C "$d"
  fi
  (cd "$d" && SPCCL_EXT_DIR="/tmp/ab_ext_$t" MAX_JOBS=6 python3 -c 'from spccl_train._ext import load_kernels; load_kernels()') \
    > "$OUT/ab/build_$t.log" 2>&1 &
done
wait
echo "builds: $((SECONDS - start)) s" | tee -a "$log"
codec_args=${CODEC_ARGS:---sizes 1G --sparsities 50,90,95,99,99.9 --dtypes fp32,bf16}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for t in $trees; do
    d=$(dir_of "$t")
    echo "=== $t round $round" | tee -a "$log"
    # shellcheck disable=SC2086 # CODEC_ARGS is a list of arguments
    (cd "$d" && SPCCL_EXT_DIR="/tmp/ab_ext_$t" SPCCL_GIT_COMMIT="$t" python3 bench/bench_codecs.py $codec_args \
      --out-dir "$OUT/ab/codecs_${t}_$round") > "$OUT/ab/codecs_${t}_$round.log" 2>&1
    grep -E "^(fp32|bf16|fp16) .* (pici|coo) " "$OUT/ab/codecs_${t}_$round.log" | tee -a "$log"
    if { [ "$round" = 1 ] && [ "${PRUNING:-1}" = 1 ]; } || [ "${PRUNING:-1}" = every ]; then
      (cd "$d" && SPCCL_EXT_DIR="/tmp/ab_ext_$t" SPCCL_GIT_COMMIT="$t" python3 bench/bench_pruning.py \
        --out-dir "$OUT/ab/pruning_${t}_$round") > "$OUT/ab/pruning_${t}_$round.log" 2>&1
      tail -n 8 "$OUT/ab/pruning_${t}_$round.log" | tee -a "$log"
    fi
  done
done
failed=0
if [ "${1:-}" = tests ]; then
  echo "=== tests (new)" | tee -a "$log"
  SPCCL_EXT_DIR=/tmp/ab_ext_new python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py \
    tests/test_pruning_wire.py 2>&1 | tail -5 | tee -a "$log"
  failed=${PIPESTATUS[0]}
fi
tar czf "$OUT/ab.tgz" -C "$OUT" ab
cp "$log" "$OUT/summary.log"
rm -rf "$OUT/ab"
exit "$failed"
