"""``python -m spccl_train.megatron``: the Megatron-core GPT entry point (:mod:`spccl_train.megatron.pretrain`)."""

import sys

from spccl_train.megatron.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
