"""Triton op: the sampled top-k threshold in one launch: draw ``|g + e|`` at random positions,
histogram the float bits, and pick the bin holding the k-th largest sample; no sort, no host sync.

For non-negative floats the bit pattern orders like the value, so bin ``bits >> 16`` (sign, 8
exponent and 7 mantissa bits) groups values within 2**-7 of each other. The threshold is the
k-th largest sampled value rounded down to its bin's lower edge: at least k samples reach it
(the reference, :func:`spccl_train.pruning.reference.threshold_from_sample`, computes the same).

Each program of the single launch histograms its share of the draws with atomics, then counts
itself done on a counter; the last program to finish reads the whole histogram, selects the bin,
writes the threshold and leaves the histogram and counter zeroed for the next call. Histogram and
counter are allocated once per device and shared by every call on it, so calls on one device must
be stream-ordered (one stream per device, as the pruner uses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sampled_threshold", "NUM_BINS"]

NUM_BINS = 1 << 15  # non-negative fp32 bit patterns >> 16
_BLOCK = 1024  # draws per program
# The whole launch runs at the selection's warp count, with the registers of its worst path.
# Holding all 32768 bins at once took 128 registers a thread at 16 warps: an SM's whole register
# file per program, so one histogram program per SM. Scanning 4096 bins a step at 16 warps (8 bins
# a thread, 8 steps, the next step's gathers in flight during this step's scan) compiles for sm_90
# to 64 registers, no spills: two programs of 16 warps per SM (the histogram of a 1 GiB gradient,
# 263 programs, fits at once on 132 SMs).
_SELECT_BLOCK = 4096
_NUM_WARPS = 16
# Per device: zeroed histogram, zeroed "programs done" counter, and a dummy for the drawn values
# when they are not returned. The kernel leaves histogram and counter zeroed after each call.
_state: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _device_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(histogram, done counter, dummy)`` for ``device``, allocated once (histogram and counter zeroed).

    Calls on one device share them, so they must be stream-ordered (one stream, as the pruner is):
    two calls in flight at once on different streams would mix their counts.
    """
    state = _state.get(device)
    if state is None:
        state = _state[device] = (
            torch.zeros(NUM_BINS, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.float32, device=device),
        )
    return state


@triton.jit
def _slot(bin, NBINS: tl.constexpr):
    # Atomics serialise per L2 line, and samples crowd into a few hundred adjacent bins: store
    # bin b at (b mod 32) * NBINS/32 + b / 32 so neighbouring bins sit on different lines.
    return (bin & 31) * (NBINS // 32) + (bin >> 5)


@triton.jit(do_not_specialize=["seed"])  # the seed changes every call: one compiled kernel for all
def _sampled_threshold_kernel(
    grad_ptr,
    error_ptr,
    hist_ptr,
    done_ptr,
    threshold_ptr,
    sample_ptr,
    numel,
    sample,
    seed,
    k,
    BLOCK: tl.constexpr,
    NBINS: tl.constexpr,
    SELECT_BLOCK: tl.constexpr,
    WRITE_SAMPLE: tl.constexpr,
):
    # Histogram: this program's BLOCK draws.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < sample
    # Philox draws, one per sample slot; the modulo bias is below numel / 2**32.
    index = tl.randint(seed, offsets).to(tl.int64) % numel
    g = tl.load(grad_ptr + index, mask=mask, other=0.0).to(tl.float32)
    e = tl.load(error_ptr + index, mask=mask, other=0.0).to(tl.float32)
    value = tl.abs(g + e)
    tl.atomic_add(hist_ptr + _slot(value.to(tl.int32, bitcast=True) >> 16, NBINS), 1, mask=mask, sem="relaxed")
    if WRITE_SAMPLE:
        tl.store(sample_ptr + offsets, value, mask=mask)

    # "Last program done": the program whose increment of the counter is the last selects.
    # Memory ordering, in the PTX memory model (the pattern of CUDA's threadFenceReduction sample
    # and CUTLASS's semaphores; untestable in the interpreter): each thread's histogram atomics
    # (atom.relaxed.gpu, performed in L2) precede its arrival at the barrier in program order; the
    # barrier synchronises every thread of the program with the one thread that performs the
    # counter's atom.acq_rel.gpu, whose release is cumulative, so it orders all of them at gpu
    # scope. The increments form one read-modify-write chain on the counter, so the program that
    # reads num_programs - 1 acquires the release of every other program. Triton broadcasts that
    # scalar through shared memory between two barriers, which orders every thread's loads below
    # after the acquire; they also bypass L1 (.cg) and read the L2, where the atomics land. No
    # program waits for another, so any residency of the grid is fine. In the interpreter the
    # programs run one after another and the last in grid order selects.
    tl.debug_barrier()
    done = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        # Count down from the top bin in steps of SELECT_BLOCK, carrying the count of the bins
        # above, and keep the first bin whose cumulative count reaches k (position NBINS: none).
        # (Gathering the permuted slots measured 2.4x faster than loading them coalesced and
        # transposing in registers.)
        tl.static_assert((SELECT_BLOCK % 32 == 0) & (NBINS % SELECT_BLOCK == 0))
        carried = tl.zeros([], dtype=tl.int32)
        first = tl.full([], NBINS, dtype=tl.int32)
        # Position start + j (bin NBINS-1-start-j) sits at slot _slot(NBINS-1-j) - start/32, as
        # start is a multiple of 32. The next step's gathers are issued before this step's scan.
        slots = _slot(NBINS - 1 - tl.arange(0, SELECT_BLOCK), NBINS)
        counts = tl.load(hist_ptr + slots, cache_modifier=".cg")
        for start in range(0, NBINS, SELECT_BLOCK):
            following = start + SELECT_BLOCK
            # A block mask, not the scalar `following < NBINS`: Triton 3.9's interpreter builds a
            # scalar comparison of loop constants as int32, which `load` rejects as a mask. The two
            # agree, as `following` and NBINS are multiples of SELECT_BLOCK.
            ahead_mask = following + tl.arange(0, SELECT_BLOCK) < NBINS
            ahead = tl.load(hist_ptr + slots - following // 32, mask=ahead_mask, other=0, cache_modifier=".cg")
            reached = carried + tl.cumsum(counts, 0) >= k
            first = tl.minimum(first, tl.min(tl.where(reached, start + tl.arange(0, SELECT_BLOCK), NBINS), 0))
            carried += tl.sum(counts, 0)
            counts = ahead
        tl.store(threshold_ptr, ((NBINS - 1 - first) << 16).to(tl.float32, bitcast=True))
        # Zero the histogram (contiguously, once every thread's gathers are done) and the counter.
        tl.debug_barrier()
        for start in range(0, NBINS, SELECT_BLOCK):
            tl.store(hist_ptr + start + tl.arange(0, SELECT_BLOCK), tl.zeros([SELECT_BLOCK], dtype=tl.int32))
        tl.store(done_ptr, 0)


def sampled_threshold(
    grad: torch.Tensor, error: torch.Tensor, sample: int, k: int, seed: int, *, return_sample: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Threshold that ``k`` of ``sample`` random ``|grad + error|`` values reach (fp32[1] on device).

    ``seed`` picks the draw (same seed, same positions). With ``return_sample`` the drawn values
    come back too, for tests. One kernel launch; the threshold is a new tensor on each call. Calls
    on one device must be stream-ordered (they share a histogram and a counter).
    """
    hist, done, dummy = _device_state(grad.device)
    threshold = torch.empty(1, dtype=torch.float32, device=grad.device)
    drawn = torch.empty(sample, dtype=torch.float32, device=grad.device) if return_sample else dummy
    grid = (triton.cdiv(sample, _BLOCK),)
    _sampled_threshold_kernel[grid](
        grad,
        error,
        hist,
        done,
        threshold,
        drawn,
        grad.numel(),
        sample,
        seed,
        k,
        BLOCK=_BLOCK,
        NBINS=NUM_BINS,
        SELECT_BLOCK=_SELECT_BLOCK,
        WRITE_SAMPLE=return_sample,
        num_warps=_NUM_WARPS,
    )
    return (threshold, drawn) if return_sample else threshold
