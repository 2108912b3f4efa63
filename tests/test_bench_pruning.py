"""``bench/bench_pruning.py --smoke`` end to end on the CPU: it writes its table, and its fused pass
is timed at the density it means to time.

Checks the script, not speed. The fused timing calls the pass again and again on one gradient;
with a leak the residue that a call leaves in the error buffer, added to the same gradient, is kept
in bursts (1-62% of the elements per call at decay 0.9), so the timed calls run without one and
each keeps what the threshold keeps of the gradient.
"""

from __future__ import annotations

import csv
import os
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_pruning.py"


def test_bench_pruning_times_the_fused_pass_at_its_density(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, str(BENCH), "--smoke", "--reps", "3", "--out-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    [path] = tmp_path.glob("pruning_cpu_*.csv")
    rows = list(csv.DictReader(path.open()))
    assert [(r["grad_dtype"], r["error_dtype"]) for r in rows] == [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]
    for r in rows:
        # a threshold of 2.5758 keeps 1% of a standard normal; 65536 elements: 0.0100 +- 0.0004
        assert 0.008 <= float(r["fused_density"]) <= 0.012, r
        assert float(r["fused_ms"]) > 0 and float(r["unfused_ms"]) > 0, r
