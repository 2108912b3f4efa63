"""``bench/bench_planning.py`` end to end, small: it times what it says and writes what it says.

Checks the script, not speed: every timed point has its figures, a point predicted too slow is
skipped with a note, the exchange size is what the group's protocol delivers (the table below
32 ranks, the scalable exchange's O(world x channels) from there), and the model's dense
prediction is the ring's bytes over the network.
"""

from __future__ import annotations

import csv
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_planning.py"


def test_bench_planning_writes_its_tables(tmp_path):
    cmd = [
        sys.executable, str(BENCH), "--size", "64M", "--worlds", "4,8,16,4096", "--channels", "1,2",
        "--gpus", "16,4096", "--networks", "25", "--max-point-s", "2", "--repeats", "2", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    [plan_csv] = [p for p in tmp_path.glob("planning_cpu_*.csv") if not p.stem.endswith("_model")]
    rows = list(csv.DictReader(plan_csv.open()))
    assert [(int(r["world"]), int(r["channels"])) for r in rows] == [(w, c) for c in (1, 2) for w in (4, 8, 16, 4096)]
    for r in rows:
        world, channels = int(r["world"]), int(r["channels"])
        assert int(r["table_bytes"]) == world * (11 + world * channels) * 8
        assert r["protocol"] == ("table" if world < 32 else "scalable")
        if r["protocol"] == "table":
            assert r["exchange_bytes"] == r["table_bytes"]
        else:  # the scalable exchange's budget: 16 bytes per rank and piece, and a few KiB
            assert int(r["exchange_bytes"]) <= 16 * world * channels + 4096
        if r["note"]:  # 4096 ranks: the synthetic table alone would take too long
            assert world == 4096 and r["note"].startswith("skipped") and not r["decide_new_ms"]
        else:
            assert 0 < float(r["decide_memo_ms"]) and 0 < float(r["decide_new_ms"]) and r["chosen"], r
            assert 0 < float(r["plan_ms"]) and r["planned"] in ("ring/pici", "direct/pici", "ring/coo", "direct/coo")
            assert 0 < float(r["reads_ms"])
            # two nodes of 8: a call on the default group weighs the hierarchical all-reduce too
            assert bool(r["total_new_default_group_ms"]) == (world == 16), r
            assert bool(r["curves_ms"]) == (world == 16), r
    model = list(csv.DictReader(next(tmp_path.glob("planning_cpu_*_model.csv")).open()))
    small = next(r for r in model if r["gpus"] == "16")
    ring = 2 * 15 / 16 * (64 << 20) / 25e9  # the dense ring's bytes per GPU over the 25 GB/s network
    assert float(small["dense_ms"]) > 1e3 * ring and float(small["speedup"]) > 1
    assert next(r for r in model if r["gpus"] == "4096")["note"].startswith("not weighed")
    assert (tmp_path / f"{plan_csv.stem}.png").stat().st_size > 5_000
