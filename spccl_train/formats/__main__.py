"""Report what Pici and COO cost on the wire for a tensor of a given size and sparsity.

    python -m spccl_train.formats [--numel N] [--dtype fp32|bf16|fp16] [--device cpu|cuda]

Draws a random tensor at each sparsity (i.i.d. zeros, like a pruned gradient), encodes it with
both formats, checks that decoding gives back the same bits, and prints payload sizes as a
fraction of the dense size, the break-even sparsities, and which codec ran (the CUDA kernels
or the torch reference).
"""

from __future__ import annotations

import argparse
import time

import torch

from .codec import coo_decode, coo_encode, pici_decode, pici_encode, uses_kernels
from .layout import dense_bytes, pici_metadata_bytes

__all__ = ["main"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SPARSITIES = (0.0, 0.5, 0.9, 0.95, 0.99, 0.999)


def _timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    """Run the report; return a process exit code (1 if any round trip differed)."""
    parser = argparse.ArgumentParser(prog="python -m spccl_train.formats", description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 22, help="elements per tensor (default 4Mi)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    dtype, device = _DTYPES[args.dtype], torch.device(args.device)
    n = args.numel
    dense = dense_bytes(n, dtype)
    probe = torch.empty(1, device=device)
    backend = "CUDA kernels" if uses_kernels(probe) else "torch reference"
    print(f"{n} elements of {dtype} on {device} ({dense / 2**20:.1f} MiB dense); codec: {backend}")
    print(f"Pici metadata: {pici_metadata_bytes(n) / dense:.2%} of dense, whatever the sparsity\n")
    print(f"{'sparsity':>9} {'nnz':>10} {'pici/dense':>11} {'coo/dense':>10} {'pici enc ms':>12} {'round trip':>11}")
    failures = 0
    generator = torch.Generator(device=device).manual_seed(0)
    for sparsity in _SPARSITIES:
        x = torch.randn(n, device=device, generator=generator).to(dtype)
        x[torch.rand(n, device=device, generator=generator) < sparsity] = 0
        pici, ms = _timed(lambda: pici_encode(x), device)
        coo = coo_encode(x)
        ok = torch.equal(pici_decode(pici, n, dtype), x) and torch.equal(coo_decode(coo, n, dtype), x)
        failures += not ok
        nnz = int((x != 0).sum())
        print(
            f"{sparsity:>9.1%} {nnz:>10} {pici.numel() / dense:>11.3f} {coo.numel() / dense:>10.3f} "
            f"{ms:>12.2f} {'exact' if ok else 'MISMATCH':>11}"
        )
    size = torch.empty((), dtype=dtype).element_size()
    print(
        f"\nPici is smaller than dense above {pici_metadata_bytes(n) / dense:.1%} sparsity; "
        f"COO above {4 / (4 + size):.1%}; Pici is smaller than COO below "
        f"{1 - pici_metadata_bytes(n) / (4 * n):.2%} (COO's 4-byte index per nonzero outweighs the bitvector)."
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
