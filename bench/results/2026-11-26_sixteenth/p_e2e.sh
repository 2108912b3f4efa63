#!/bin/bash
# device (1 H200): GPT-2 XL, 2 ranks on GPU 0 as 2 emulated nodes, the shipped SpCCL config, 100
# iterations; this tree and the base (.ab/base.tar) alternated (ORDER). Logs and runs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || cat $OUT/install.log
rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .ab/base.tar -C /tmp/base
i=0
for tree in ${ORDER:-new base new}; do
  i=$((i + 1))
  pp=$([ $tree = base ] && echo /tmp/base || echo $PWD)
  (cd $pp && PYTHONPATH=$pp CUDA_VISIBLE_DEVICES=0 NPROC=2 timeout 190 launch/torchrun.sh --emulate-nodes 2 configs/gpt2_xl_spccl.yaml \
    model.n_layer=48 output.dir=$OUT/runs output.name=spccl_${i}_$tree output.progress=false > $OUT/train_${i}_$tree.log 2>&1)
  echo "$i $tree: $(grep -E '^  iteration |communication|forward|loss' $OUT/train_${i}_$tree.log | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
done
