#!/bin/bash
# device (1 GPU): host time per codec message, base and new alternated; then the CUDA tests
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || cat $OUT/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .ab/base.tar -C /tmp/base
for r in 1 2; do for tree in base new; do
  pp=$([ $tree = base ] && echo /tmp/base || echo $PWD)
  echo "== round $r $tree"; PYTHONPATH=$pp python3 .ab/wirebench.py 2>&1 | tee $OUT/wire_${r}_$tree.log
done; done
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py tests/test_pruning_wire.py tests/test_collectives_cuda.py tests/test_ddp_cuda.py > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
