#!/bin/bash
# device (1 GPU): the kernel and prune-to-the-wire tests on this tree's build, then ROUNDS rounds of
# p_sweeps.sh (2 and 4 ranks on GPU 0 as emulated nodes). Logs under $OUT.
here=bench/results/2026-11-26_seventeenth
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
python3 -c 'from spccl_train._ext import load_kernels; load_kernels(); print("kernels loaded")' 2>&1 | tail -1
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py tests/test_pruning_wire.py > $OUT/tests.log 2>&1
  echo "tests: $(tail -1 $OUT/tests.log)"
fi
bash $here/p_sweeps.sh
