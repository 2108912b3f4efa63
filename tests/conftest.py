"""Test-session setup shared by every test module."""

import os

import torch

# Without a GPU, run the Triton kernels in Triton's interpreter so they are tested against
# the torch reference on CPU. Must be set before any Triton kernel is defined (imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
