"""Round three: bench_codecs measured bf16 Pici compress at 50% (1 GiB) at 0.650 ms where the same
call timed alone read 0.630 in the same process (churn.py). This runs bench_codecs' own case
(_bench_case) with its timer replaced by one that keeps every call's time and how long the host
took to queue them against the GPU's hold, to see whether some calls are slow or all are.
Run: python3 percall.py   (from the repository root)
Then the same inside bench_codecs.main (its default sweep, bf16 only), twice. With the argument
`sweep`: only the sweep, once, with bench_codecs' timer as it is (its times kept, and the SM clock
from the hold's length); `sweep idle`: the same with the device idle 100 ms after each case's free.
Run at 1406916: it patches bench_codecs._median_ms, which 9a96574 renamed (_time_ms, returning the
fastest and slowest rep too), and since a108443 bench_codecs idles after each free.
"""

import dataclasses
import math
import statistics
import sys
import time

import torch

sys.path.insert(0, "bench")
import bench_codecs  # noqa: E402

from spccl_train._ext import load_kernels  # noqa: E402

LOG = []


def median_ms(step, device, reps, warmup):
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    hold = torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(bench_codecs._HOLD_CYCLES)
    hold.record()
    t0 = time.perf_counter()
    for i in range(reps):
        starts[i].record()
        step(i)
        ends[i].record()
    queued = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    t = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    between = [ends[i].elapsed_time(starts[i + 1]) for i in range(reps - 1)]
    LOG.append((t, queued, hold.elapsed_time(starts[0]), between))
    return statistics.median(t)


def median_ms_same(step, device, reps, warmup):
    """bench_codecs._median_ms as it is, keeping the calls' times."""
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    hold = torch.cuda.Event(enable_timing=True)
    hold.record()
    torch.cuda._sleep(bench_codecs._HOLD_CYCLES)
    for i in range(reps):
        starts[i].record()
        step(i)
        ends[i].record()
    torch.cuda.synchronize()
    t = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    between = [ends[i].elapsed_time(starts[i + 1]) for i in range(reps - 1)]
    # the hold spins a number of SM cycles: its length gives the SM clock
    LOG.append((t, bench_codecs._HOLD_CYCLES / 1e3 / hold.elapsed_time(starts[0]), float("nan"), between))
    return statistics.median(t)


def show(tag, rows):
    t, queued, first, between = LOG[0]  # the case's first timing: Pici compress
    print(
        f"{tag}: median {rows[0].time_ms:.3f} ms; calls "
        + " ".join(f"{v:.3f}" for v in t)
        + (
            f"\n  SM clock in the hold {queued:.0f} MHz;"
            if math.isnan(first)
            else f"\n  host queued them in {queued:.2f} ms; the first started {first:.3f} ms after the hold;"
        )
        + f" gaps between calls {min(between) * 1e3:.0f}-{max(between) * 1e3:.0f} us",
        flush=True,
    )


def main():
    load_kernels()
    if sys.argv[1:2] == ["sweep"]:  # only the sweep, the timer's GPU work as it is
        bench_codecs._median_ms = median_ms_same
        if sys.argv[2:] == ["idle"]:  # the device left idle for 100 ms after each case's cache is freed
            free = bench_codecs.benchlib.free_cache

            def free_and_idle(device):
                free(device)
                torch.cuda.synchronize()
                time.sleep(0.1)

            bench_codecs.benchlib.free_cache = free_and_idle
        trace_main(1)
        return
    bench_codecs._median_ms = median_ms
    settings = bench_codecs._settings(["--dtypes", "bf16", "--sizes", "1G", "--sparsities", "50"])
    for warmup in (3, 0, 10):
        LOG.clear()
        case = dataclasses.replace(settings, warmup=warmup)
        show(f"alone, warmup {warmup}", bench_codecs._bench_case("bf16", 1 << 30, 50.0, case, "kernels"))
    trace_main(2)


def trace_main(times):
    """bench_codecs.main's order (its default sweep with bf16 only), the 1 GiB cases shown."""
    bench_case = bench_codecs._bench_case

    def traced(dtype_name, size, sparsity, settings, backend):
        LOG.clear()
        rows = bench_case(dtype_name, size, sparsity, settings, backend)
        if size == 1 << 30 and sparsity in (50.0, 90.0):
            show(f"in main, {sparsity:g}%", rows)
        return rows

    bench_codecs._bench_case = traced
    for _ in range(times):
        bench_codecs.main(["--dtypes", "bf16", "--out-dir", "/tmp/percall"])


if __name__ == "__main__":
    main()
