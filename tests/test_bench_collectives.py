"""The collective benchmark's ``--smoke`` mode runs end to end under torchrun (2 gloo ranks on CPU).

Checks the script, not speed (benchmarks assert no timings): every point of the smoke grid (all
collectives, methods and input patterns) and of a small channel / threshold sweep in bf16 is
verified against the dense collective, the CSV has the documented columns, and the heatmaps
are written. ``torch.distributed.run --standalone`` picks a free port for the rendezvous.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_collectives.py"
TIMEOUT_S = 240
COLUMNS = {
    "date", "device", "commit", "world_size", "collective", "method", "format", "algorithm", "dtype", "pattern",
    "size_bytes", "sparsity", "time_ms", "algbw_GBps", "busbw_GBps", "bytes_ratio", "speedup_vs_nccl",
    "speedup_vs_naive", "predicted_ms", "host_ms", "device_allocs", "verified",
}  # fmt: skip


def _run(out_dir: pathlib.Path, *args: str) -> list[dict[str, str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(BENCH)]
    done = subprocess.run(
        [*cmd, "--smoke", "--out-dir", str(out_dir), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        cwd=BENCH.parent.parent,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    assert "verification:" in done.stdout, done.stdout[-3000:]
    (path,) = (p for p in out_dir.glob("collectives_cpux2_*.csv") if not p.stem.endswith("_trace"))
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_smoke_grid(tmp_path):
    rows = _run(tmp_path)
    assert rows and COLUMNS <= set(rows[0])
    assert all(r["verified"] == "True" for r in rows), [r for r in rows if r["verified"] != "True"][:3]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert {r["pattern"] for r in rows} == {"iid", "identical", "disjoint", "clustered"}
    assert {"nccl", "naive_coo", "auto/auto", "pici/ring", "pici/direct", "coo/ring", "coo/direct"} <= {
        r["method"] for r in rows
    }
    assert {r["world_size"] for r in rows} == {"2"}
    for r in rows:
        assert float(r["time_ms"]) > 0 and float(r["busbw_GBps"]) > 0, r  # 6 significant digits, never 0
        # each call returns before its device work ends, so the median host time cannot pass the median call
        assert 0 < float(r["host_ms"]) <= float(r["time_ms"]) and r["device_allocs"] == "0", r
        if r["method"] == "nccl":
            assert r["speedup_vs_nccl"] == "" and float(r["bytes_ratio"]) == 1.0, r
        else:
            assert float(r["speedup_vs_nccl"]) > 0, r
        if r["method"] not in ("nccl", "naive_coo"):
            assert r["predicted_ms"] != "" and float(r["speedup_vs_naive"]) > 0, r
    # the host's times are their own, not the calls' (which end after the return)
    assert any(float(r["host_ms"]) < float(r["time_ms"]) for r in rows)
    # auto's rows rate its time and, where its timed calls ran one candidate, that candidate's own
    fixed = ("nccl", "pici/ring", "pici/direct", "coo/ring", "coo/direct")
    times, fastest = {}, {}
    for r in rows:
        if r["method"] in fixed:
            at = (r["collective"], r["pattern"], r["size_bytes"], r["sparsity"])
            times.setdefault(at, {})[r["method"]] = float(r["time_ms"])
            fastest.setdefault(at, {})[r["method"]] = float(r["time_min_ms"])
    for r in (r for r in rows if r["method"] == "auto/auto"):
        at = times[(r["collective"], r["pattern"], r["size_bytes"], r["sparsity"])]
        ran = r["timed_chosen"].split(">")
        assert ran[0] and all(name in r["chosen"] for name in ran), r
        assert float(r["auto_vs_best"]) == pytest.approx(float(r["time_ms"]) / min(at.values()), rel=1e-3), r
        best = fastest[(r["collective"], r["pattern"], r["size_bytes"], r["sparsity"])][min(at, key=at.get)]
        assert float(r["fastest_vs_best"]) == pytest.approx(float(r["time_min_ms"]) / best, rel=1e-3), r
        if len(ran) == 1:
            algorithm, fmt = ran[0].split("/")
            own = at["nccl" if algorithm == "native" else f"{fmt}/{algorithm}"]
            assert float(r["choice_vs_best"]) == pytest.approx(own / min(at.values()), rel=1e-3), r
        else:
            assert r["choice_vs_best"] == "", r
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(list(tmp_path.glob("collectives_cpux2_*_all_reduce_iid_fp32.png"))) == 1


def test_sweeps_bf16(tmp_path):
    rows = _run(
        tmp_path,
        *("--collectives", "all_reduce,reduce_scatter", "--patterns", "disjoint", "--sizes", "64K"),
        *("--sparsities", "99", "--dtype", "bf16", "--methods", "nccl,auto/auto,pici/ring,coo/direct"),
        *("--channels", "1,2", "--thresholds-sweep", "0.5,1", "--no-plot", "--settle", "4", "--trace", "--warmup", "2"),
    )
    assert rows and all(r["verified"] == "True" for r in rows)
    # --settle: auto takes 2 to 4 more untimed calls (it stops at two equal choices in a row); fixed methods none
    for r in rows:
        assert (2 <= int(r["settle"]) <= 4) if r["method"] == "auto/auto" else r["settle"] == "0", r
        assert r["warmup"] == "2", r
    # --trace: every call of auto's points, in order, and nothing of the fixed methods
    (path,) = tmp_path.glob("collectives_cpux2_*_trace.csv")
    with path.open(newline="") as f:
        calls = list(csv.DictReader(f))
    autos = [r for r in rows if r["method"] == "auto/auto"]
    assert {c["method"] for c in calls} == {"auto/auto"}
    assert len(calls) == sum(1 + int(r["warmup"]) + int(r["settle"]) + int(r["iters"]) for r in autos)
    for r in autos:
        at = (r["collective"], r["size_bytes"], r["sparsity"], r["channels"])
        mine = [c for c in calls if (c["collective"], c["size_bytes"], c["sparsity"], c["channels"]) == at]
        assert [c["phase"] for c in mine] == ["verify"] + ["warmup"] * int(r["warmup"]) + ["settle"] * int(
            r["settle"]
        ) + ["timed"] * int(r["iters"]), mine
        for c in mine:
            assert c["ran"] in r["chosen"], (c, r["chosen"])
            figures = {name: float(ms) for name, ms in (kv.rsplit(":", 1) for kv in c["candidates_ms"].split())}
            assert list(figures.values()) == sorted(figures.values()), c
            # the prediction is the figure the candidate was weighed with (corrected)
            assert float(c["predicted_ms"]) == pytest.approx(figures[c["ran"]], abs=2e-3), c
            assert float(c["time_ms"]) > 0 and 0 < float(c["host_ms"]) <= float(c["time_ms"]), c
    pici = {(r["channels"], r["threshold_scale"]) for r in rows if r["method"] == "pici/ring"}
    assert pici == {("1", "1.0"), ("1", "0.5"), ("2", "1.0"), ("2", "0.5")}
    assert {(r["channels"], r["threshold_scale"]) for r in rows if r["method"] == "auto/auto"} == {
        ("1", "1.0"),
        ("2", "1.0"),
    }
    assert not list(tmp_path.glob("*.png"))


def test_bad_argument_fails_before_joining_a_job():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--methods", "pici/none"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "method 'pici/none' is not one of" in done.stderr, done.stderr


def test_bounds_bench_redraws_its_heatmaps(tmp_path):
    # bench_bounds.py needs NCCL to measure; its --plot mode draws a CSV it wrote, here one row of each kind
    path = tmp_path / "collectives_bounds_x.csv"
    header = "date,device,world,commit,torch,collective,bytes,sparsity,channels,variant,plan,ms,speedup_vs_nccl,host_ms"
    rows = [
        f"d,GPU,4,abc,t,{c},{n},{sp},1,{v},p,1.0,{1.5 if v != 'nccl' else 1.0},nan"
        for c in ("all_reduce", "all_gather")
        for n in (1 << 26, 1 << 30)
        for sp in (0.0, 99.0)
        for v in ("nccl", "auto+bounds+graph")
    ]
    path.write_text("\n".join([header, *rows]) + "\n")
    done = subprocess.run(
        [sys.executable, str(BENCH.parent / "bench_bounds.py"), "--plot", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=BENCH.parent.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if importlib.util.find_spec("matplotlib") is not None:
        assert path.with_suffix(".png").stat().st_size > 0


def test_hierarchical_methods_run_on_request(tmp_path):
    # 2 ranks as 2 nodes of 1: one level, so the flat call runs (the plumbing, not the algorithm:
    # tests/test_hierarchical.py checks that on 4 x 2, 3 x 4 and 2 x 8 ranks)
    rows = _run(
        tmp_path, "--methods", "nccl,coo/hierarchical", "--ranks-per-node", "1", "--patterns", "iid", "--no-plot"
    )
    assert {r["method"] for r in rows} == {"nccl", "coo/hierarchical"}
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(r["verified"] == "True" for r in rows)


@pytest.fixture
def bench(monkeypatch):
    """The benchmark's module, imported as its script runs."""
    monkeypatch.syspath_prepend(str(BENCH.parent))  # its helpers, as when it runs as a script
    spec = importlib.util.spec_from_file_location("bench_collectives_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_methods_that_choose_nothing_run_on_a_group_of_their_own(bench, monkeypatch):
    """What a fixed method's calls teach the measured model's corrections (per group) is not
    auto's to use: in training auto learns from its own calls alone. The hierarchical algorithm
    makes its node subgroups from the default group and stays there."""
    groups = []
    monkeypatch.setattr(bench.spccl_train, "all_reduce", lambda tensor, group=None, config=None: groups.append(group))
    monkeypatch.setattr(bench, "last_stats", lambda: None)
    own = object()
    env = bench._Env(rank=0, world=2, device=torch.device("cpu"), backend="gloo", fixed_group=own)
    case = bench._Case(
        collective="all_reduce", dtype_name="fp32", dtype=torch.float32, pattern="iid", sparsity=99.0,
        size_bytes=64, x0=torch.zeros(16), fingerprint=0, ref=torch.zeros(16), tol=None, work=torch.zeros(16),
    )  # fmt: skip
    for fmt, algorithm in (("pici", "ring"), ("coo", "direct"), ("auto", "auto"), ("auto", "ring"), ("pici", "auto")):
        bench._call(bench._Method(f"{fmt}/{algorithm}", fmt, algorithm), case, env)
    bench._call(bench._Method("coo/hierarchical", "coo", "hierarchical"), case, env)
    assert groups == [own, own, None, None, None, None]


def test_a_trace_names_what_ran_as_the_candidates_are_named(bench):
    """A trace row's ``ran`` is a key of its ``candidates_ms``: a hierarchical call (whose stats carry
    its network step's format) is ``hierarchical``, as auto weighed it."""
    from spccl_train.formats import Format

    case = bench._Case(
        collective="all_reduce", dtype_name="fp32", dtype=torch.float32, pattern="iid", sparsity=99.0,
        size_bytes=64, x0=torch.zeros(16), fingerprint=0, ref=torch.zeros(16), tol=None, work=torch.zeros(16),
    )  # fmt: skip
    method = bench._Method("auto/auto", "auto", "auto")
    for algorithm, fmt, name in (("hierarchical", Format.COO, "hierarchical"), ("direct", Format.PICI, "direct/pici")):
        stats = types.SimpleNamespace(
            algorithm=algorithm, format=fmt, trial=False, predicted_s=0.002, exchanges=1,
            candidates={"direct/pici": 0.003, name: 0.002, "native/dense": 0.009},
        )  # fmt: skip
        record = bench._trace_record(method, case, "timed", bench._Timed(0.0025, stats, 0, 0.001))
        assert record["ran"] == name
        assert record["candidates_ms"].split()[0] == f"{name}:2.0000"
        assert (record["predicted_ms"], record["time_ms"], record["host_ms"]) == ("2.0000", "2.5000", "1.0000")


def test_auto_settles_when_its_predictions_stop_moving(bench):
    """Two equal choices in a row settle auto only if the model did not move between them."""
    before = {"direct/pici": 10.0, "direct/coo": 11.0, "native/dense": 40.0}
    assert bench._same_weighing(before, {"direct/pici": 10.19, "direct/coo": 10.8, "native/dense": 40.5})
    assert not bench._same_weighing(before, {"direct/pici": 10.3, "direct/coo": 11.0, "native/dense": 40.0})
    assert not bench._same_weighing(before, {"direct/pici": 10.0, "direct/coo": 11.0})
    assert not bench._same_weighing({}, before)  # the first call of a run of equal choices


@pytest.fixture
def one_rank(bench, monkeypatch):
    """The benchmark's point loop in one process: gates and reductions of one rank, calls recorded
    (``calls``: the methods in the order they ran; ``fail``: method -> the call of it that raises,
    or ``"peer"`` -> (calls made, the failing rank's gate value): a peer's failure, met at the gate
    after that many calls)."""
    calls, fail = [], {}

    def call(method, case, env):
        calls.append(method.name)
        if fail.get(method.name) == calls.count(method.name):
            raise RuntimeError(f"{method.name} broke")
        return None, 0

    def gate(env, failed=False, value=0.0):
        # "peer": (calls made, the failing rank's value): a peer failed after that many calls
        if "peer" in fail and fail["peer"][0] == len(calls):
            raise bench._PeerFailed(fail.pop("peer")[1])
        return value

    monkeypatch.setattr(bench, "_call", call)
    monkeypatch.setattr(bench, "_gate", gate)
    monkeypatch.setattr(bench, "_reduce", lambda env, values, op: list(values))
    monkeypatch.setattr(bench, "_matches", lambda case: True)
    env = bench._Env(rank=0, world=2, device=torch.device("cpu"), backend="gloo", fixed_group=None)
    case = bench._Case(
        collective="all_reduce", dtype_name="fp32", dtype=torch.float32, pattern="iid", sparsity=99.0,
        size_bytes=64, x0=torch.zeros(16), fingerprint=0, ref=torch.zeros(16), tol=None, work=torch.zeros(16),
    )  # fmt: skip
    settings = bench._settings(["--smoke", "--iters", "3", "--warmup", "1", "--methods", "nccl,pici/ring,coo/direct"])
    methods = bench._methods(settings)
    assert [m.name for m in methods] == ["nccl", "pici/ring", "coo/direct"]

    def run():
        return bench._run_case(case, methods, env, settings, lambda row: None)

    return run, calls, fail


def test_a_case_starts_with_the_holds_released(one_rank, bench, monkeypatch):
    """Under ``--check-calls first`` each case starts with the holds released (the points of one
    size share a shape), once, before its methods are readied; checking every call, never."""
    run, calls, _ = one_rank
    released = []
    monkeypatch.setattr(bench, "release_holds", lambda: released.append(len(calls)))
    env = bench._Env(rank=0, world=2, device=torch.device("cpu"), backend="gloo", fixed_group=None)
    case = bench._Case(
        collective="all_reduce", dtype_name="fp32", dtype=torch.float32, pattern="iid", sparsity=99.0,
        size_bytes=64, x0=torch.zeros(16), fingerprint=0, ref=torch.zeros(16), tol=None, work=torch.zeros(16),
    )  # fmt: skip
    for check, want in (("first", [0]), ("every", [])):
        released.clear()
        calls.clear()
        args = ["--smoke", "--iters", "1", "--warmup", "0", "--check-calls", check]
        settings = bench._settings([*args, "--methods", "nccl,auto/auto,pici/ring,auto/auto"])
        bench._run_case(case, bench._methods(settings), env, settings, lambda row: None)
        assert released == want and calls, (check, released, calls)


def test_methods_are_timed_in_turns(one_rank):
    """Each method is verified and warmed up on its own, then the timed calls go one of each method
    per turn: every method sees the same windows of a link whose speed drifts. Each turn has its
    own order, so that no method always follows the same one."""
    run, calls, _ = one_rank
    rows = run()
    ready = ["nccl", "nccl", "pici/ring", "pici/ring", "coo/direct", "coo/direct"]  # verification, warm-up
    methods = ["nccl", "pici/ring", "coo/direct"]
    assert calls[:6] == ready and len(calls) == 6 + 3 * 3, calls  # three turns of three
    turns = [calls[6 + 3 * t : 9 + 3 * t] for t in range(3)]
    assert all(sorted(turn) == sorted(methods) for turn in turns), turns
    assert len({tuple(turn) for turn in turns}) > 1, turns  # (the orders are drawn from the case: fixed)
    assert all(r.verified and r.iters == 3 and r.time_ms > 0 and not r.error for r in rows), rows


def test_a_failed_timed_call_stops_the_turns(one_rank):
    """A failure in the timed calls stops them for the case: the failing method says why, and the
    methods it left short fail with it instead of being timed over fewer windows."""
    run, calls, fail = one_rank
    fail["pici/ring"] = 4  # verification, warm-up, timed call 1, timed call 2
    rows = {r.method: r for r in run()}
    first, second = calls[6:9], calls[9:]
    assert sorted(first) == ["coo/direct", "nccl", "pici/ring"], calls  # the first turn, whole
    assert second[-1] == "pici/ring" and "pici/ring" not in second[:-1], calls  # the second, up to the failure
    assert rows["pici/ring"].error == "RuntimeError: pici/ring broke"
    assert rows["nccl"].error == rows["coo/direct"].error == "not timed: pici/ring failed in the timed calls"
    assert not any(r.verified for r in rows.values())


def test_a_peers_failure_is_blamed_on_its_method(one_rank):
    """A rank whose peer failed meets the failure at its own next call, perhaps another method's:
    it blames the method the failing rank named, as the failing rank does."""
    run, calls, fail = one_rank
    fail["peer"] = (11, 2.0)  # met at this rank's 11th call: the peer failed in pici/ring (place 2)
    rows = {r.method: r for r in run()}
    assert len(calls) == 11  # the turn's last call was not made
    assert rows["pici/ring"].error == "failed on another rank"
    assert rows["nccl"].error == rows["coo/direct"].error == "not timed: pici/ring failed in the timed calls"
