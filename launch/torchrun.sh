#!/usr/bin/env bash
# Single node: one rank per GPU (or NPROC ranks), all arguments after the config passed on.
#   launch/torchrun.sh configs/gpt2_xl_spccl.yaml [train.iterations=50 ...]
#   NPROC=2 launch/torchrun.sh configs/gpt2_xl_dense.yaml
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
config=${1:?usage: launch/torchrun.sh CONFIG.yaml [--use-spccl] [key=value ...]}
shift
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi
exec torchrun --standalone --nproc-per-node="$NPROC" -m spccl_train.cli --config "$config" "$@"
