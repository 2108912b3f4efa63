#!/usr/bin/env bash
# Single host: one rank per GPU (or NPROC ranks), all arguments after the config passed on.
#   launch/torchrun.sh configs/gpt2_xl_spccl.yaml [train.iterations=50 ...]
#   NPROC=2 launch/torchrun.sh configs/gpt2_xl_dense.yaml
#   launch/torchrun.sh --emulate-nodes 2 configs/gpt2_xl_spccl.yaml      # this host as 2 nodes
#   NPROC=2 launch/torchrun.sh --emulate-nodes 2 configs/gpt2_xl_spccl.yaml   # even on one GPU
# --emulate-nodes N splits the ranks into N emulated nodes joined by NCCL's socket transport
# (spccl_train/emulation.py says what that emulates and what it does not); NPROC may exceed the
# GPUs, and ranks then share them.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
emulate=()
if [ "${1:-}" = "--emulate-nodes" ]; then
  emulate=("dist.emulate_nodes=${2:?--emulate-nodes takes a number of nodes}")
  shift 2
fi
config=${1:?usage: launch/torchrun.sh [--emulate-nodes N] CONFIG.yaml [--use-spccl] [key=value ...]}
shift
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi
exec torchrun --standalone --nproc-per-node="$NPROC" -m spccl_train.cli --config "$config" "${emulate[@]}" "$@"
