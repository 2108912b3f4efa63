"""The measured cost model (``collectives/links.py``) and emulated nodes (``emulation.py``) on CPU.

On gloo the probe measures gloo's links: what is checked is that it runs collectively, finds the
hop kinds the topology has, gives every rank the same figures, is made once per group and
topology, feeds ``auto``, and that codec calibrations are cached per device and version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from _pool import pool_factory
from _stopped import Stopped

import spccl_train
from spccl_train.collectives import CollectiveConfig, Topology, feedback, last_stats, links
from spccl_train.collectives.cost import CodecCost, CostModel, NativeCost
from spccl_train.emulation import emulate_nodes, node_env
from spccl_train.transport import P2PTransport


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    yield from pool_factory(tmp_path_factory, "links")


def _job_probe(rank, world, ranks_per_node):
    probe = links.probe_links(P2PTransport(), Topology(world, ranks_per_node), torch.device("cpu"))
    return probe.intra, probe.inter, probe.native, probe.exchange_s


@pytest.mark.parametrize(
    "world, ranks_per_node, kinds", [(4, 2, {"intra", "inter"}), (2, None, {"intra"}), (2, 1, {"inter"})]
)
def test_probe_finds_the_hop_kinds_and_agrees_on_every_rank(pools, world, ranks_per_node, kinds):
    got = pools(world).run(_job_probe, ranks_per_node)
    assert all(g == got[0] for g in got), "ranks disagree on the measured links"
    intra, inter, native, exchange_s = got[0]
    assert {k for k, v in (("intra", intra), ("inter", inter)) if v is not None} == kinds
    for link in (intra, inter, native):
        if link is not None:
            assert link.bandwidth > 1e6 and 0 <= link.latency_s < 0.5
    assert native.topology == Topology(world, ranks_per_node)
    assert 0 < exchange_s < 1.0


def test_the_native_call_is_predicted_from_its_own_timing_on_its_own_group():
    base = CostModel.default("cuda")
    group = Topology(4, 1)
    slow = NativeCost(topology=group, latency_s=1e-3, bandwidth=0.5e9)
    model = dataclasses.replace(base, native=slow)
    numel, size = 64 << 20, 4
    planning = model.planning("all_reduce", numel, torch.float32, 4)
    pushed = 2 * 3 * numel * size / 4
    assert model.predict_native("all_reduce", numel, torch.float32, group) == pytest.approx(
        planning + 1e-3 + pushed / 0.5e9
    )
    gather = model.predict_native("all_gather", numel, torch.float32, group)
    # one ring, not two: half the bytes and half the start-up
    assert gather == pytest.approx(model.planning("all_gather", numel, torch.float32, 4) + (1e-3 + pushed / 0.5e9) / 2)
    # another group (a hierarchical step's subgroup, another node layout): the links, as before
    for other in (Topology(2, 1), Topology(4, 2)):
        assert model.predict_native("all_reduce", numel, torch.float32, other) == base.predict_native(
            "all_reduce", numel, torch.float32, other
        )
    assert model.fingerprint() != base.fingerprint()


@contextlib.contextmanager
def _counting_probes(cache_dir):
    """A fresh measured-model cache under ``cache_dir``, and a list that counts the link probes."""
    os.environ["SPCCL_CACHE_DIR"] = cache_dir
    links.forget_measured()
    calls = []
    real = links.probe_links
    links.probe_links = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        yield calls
    finally:
        links.probe_links = real


def _job_auto_measured(rank, world, cache_dir):
    with _counting_probes(cache_dir) as calls:
        x = torch.zeros(world * 5000)
        x[rank::97] = 1.0
        for _ in range(3):
            spccl_train.all_reduce(x.clone())  # default config: format / algorithm auto, cost_model measured
        stats = last_stats()
        other_group = dist.new_group()  # a new group measures its own links
        spccl_train.all_reduce(x.clone(), group=other_group)
    from spccl_train.collectives.choice import NATIVE_MARGIN, STICKY_MARGIN, TRIAL_MARGIN

    best = min(stats.candidates.values())
    weighed = (
        stats.predicted_s == best
        or (stats.algorithm == "native" and best >= (1 - NATIVE_MARGIN) * stats.candidates["native/dense"])
        or (stats.algorithm != "native" and stats.predicted_s * (1 - STICKY_MARGIN) <= best)
        or (stats.trial and stats.predicted_s <= (1 + TRIAL_MARGIN) / (1 - NATIVE_MARGIN) * best)
    )  # the cheapest; native when no sparse candidate wins clearly; the last sparse one within its
    # margin; a near-tied one on trial (near the choice, which may be native kept by its margin)
    return len(calls), sorted(stats.candidates.items()), weighed


def test_auto_uses_one_measured_model_per_group(pools, tmp_path):
    got = pools(3).run(_job_auto_measured, str(tmp_path))
    assert all(g == got[0] for g in got), "ranks weighed the candidates differently"
    probes, candidates, chose_cheapest = got[0]
    assert probes == 2 and chose_cheapest and len(candidates) > 1
    assert (
        len(list((tmp_path / "codecs").glob(f"cpu-reference-{spccl_train.__version__}-{links.CALIBRATION}.json"))) == 1
    )


def test_codec_calibration_is_cached_per_device_and_version(tmp_path, monkeypatch):
    monkeypatch.setenv("SPCCL_CACHE_DIR", str(tmp_path))
    first = links.codec_costs(torch.device("cpu"))
    for cost in first.values():
        assert cost.compress > 0 and cost.decompress > 0 and cost.accumulate > 0 and cost.call_s > 0
    (path,) = (tmp_path / "codecs").iterdir()
    assert path.name == f"cpu-reference-{spccl_train.__version__}-{links.CALIBRATION}.json"
    saved = json.loads(path.read_text())
    saved["pici"]["compress"] = 123.0  # the cache, not a new measurement, answers next time
    path.write_text(json.dumps(saved))
    assert links.codec_costs(torch.device("cpu"))["pici"].compress == 123.0
    path.write_text("not json")
    assert links.codec_costs(torch.device("cpu"))["pici"].compress != 123.0  # unreadable: measured again


def test_codec_throughput_leaves_the_host_cost_of_a_call_out():
    # 40 us of launch and sync per call, 1 ms per 2.5 GB: the two sizes' extra bytes over their
    # extra time, not either size's bytes over its whole time
    small, large = 2.5e8, 2.0e9
    t = [40e-6 + b / 2.5e12 for b in (small, large)]
    assert links._throughput(int(large - small), t[1] - t[0], int(large), t[1]) == pytest.approx(2.5e12)
    assert large / t[1] < 0.99 * 2.5e12
    # a stall on the smaller size (the larger no longer than it): the larger size's own rate
    assert links._throughput(int(large - small), 1e-6, int(large), 1e-3) == pytest.approx(2.0e12)


def _job_ranks_per_node_from_env(rank, world):
    from spccl_train.collectives.context import ranks_per_node

    transport = P2PTransport()
    found = []
    for env in ({}, {"LOCAL_WORLD_SIZE": "2"}, {"SPCCL_RANKS_PER_NODE": "1", "LOCAL_WORLD_SIZE": "2"}):
        saved = {k: os.environ.pop(k, None) for k in ("SPCCL_RANKS_PER_NODE", "LOCAL_WORLD_SIZE")}
        os.environ.update(env)
        try:
            found.append(ranks_per_node(CollectiveConfig(), transport))
            found.append(ranks_per_node(CollectiveConfig(ranks_per_node=4), transport))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
    sub = dist.new_group([0, 1])
    if rank < 2:
        os.environ["SPCCL_RANKS_PER_NODE"] = "1"
        # a subgroup: its own nodes, from its members' global ranks (one rank per node here)
        found.append(ranks_per_node(CollectiveConfig(), P2PTransport(sub)))
        del os.environ["SPCCL_RANKS_PER_NODE"]
    return found


def test_topology_follows_the_launch_when_the_config_leaves_it(pools):
    got = pools(4).run(_job_ranks_per_node_from_env)
    assert got[0] == [None, 4, 2, 4, 1, 4, 1]


def test_measured_figures_replace_the_defaults_and_the_rest_stay():
    base = CostModel.default("cpu")
    slow = CodecCost(compress=1.0, decompress=2.0, accumulate=3.0, call_s=4.0)
    assert dataclasses_replace_keeps(base, slow)


def dataclasses_replace_keeps(base, codec):
    model = dataclasses.replace(base, pici=codec)
    return model.pici == codec and model.coo == base.coo and model.fingerprint() != base.fingerprint()


@pytest.mark.parametrize("local_world, nodes", [(4, 2), (2, 2), (8, 4), (4, 1)])
def test_emulated_node_env_per_rank(local_world, nodes):
    per_node = local_world // nodes
    ids = []
    for local_rank in range(local_world):
        placed, env = node_env(local_rank, local_world, nodes, {})
        assert placed.node == local_rank // per_node and placed.ranks_per_node == per_node
        assert env["SPCCL_RANKS_PER_NODE"] == str(per_node) and env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_IB_DISABLE"] == "1"
        ids.append(env["NCCL_HOSTID"])
    assert len(set(ids)) == nodes  # one host id per emulated node, shared by its ranks
    assert all(ids[r] == ids[r // per_node * per_node] for r in range(local_world))


def test_emulated_nodes_keep_the_users_socket_settings_and_set_the_process_env():
    _, env = node_env(0, 2, 2, {"NCCL_SOCKET_IFNAME": "eth9", "NCCL_IB_DISABLE": "0"})
    assert env["NCCL_SOCKET_IFNAME"] == "eth9" and env["NCCL_IB_DISABLE"] == "0"
    environ = {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    placed = emulate_nodes(2, environ)
    assert placed.node == 1 and environ["SPCCL_RANKS_PER_NODE"] == "2" and environ["NCCL_HOSTID"].endswith("node1")
    assert emulate_nodes(1, environ := {}) is None and environ == {}


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 4, 3), "do not split into 3 equal nodes; pick a number of nodes that divides 4 \\(e.g. 1, 2, 4\\)"),
        ((4, 4, 2), "local rank 4 is outside 0..3"),
        ((0, 4, 0), "nodes=0 must be a positive int"),
    ],
)
def test_emulated_node_errors_name_the_value_and_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        node_env(*args, {})


def test_emulated_nodes_need_the_launch_variables():
    with pytest.raises(ValueError, match="need LOCAL_RANK and LOCAL_WORLD_SIZE"):
        emulate_nodes(2, {})


def _job_sharing(rank, world, cache_dir):
    os.environ["SPCCL_CACHE_DIR"] = cache_dir
    links.forget_measured()
    measured = links.measured_model(P2PTransport(), Topology(world), torch.device("cpu"))
    return measured.model.pici.compress, measured.model.coo.accumulate


def test_ranks_sharing_a_device_split_its_codec_throughput(pools, tmp_path):
    got = pools(3).run(_job_sharing, str(tmp_path))
    assert all(g == got[0] for g in got)
    (path,) = (tmp_path / "codecs").iterdir()  # one calibration, made by the first rank in turn
    saved = json.loads(path.read_text())
    # three gloo ranks share the CPU: each is priced at a third of what the device did alone
    assert got[0][0] * 3 == pytest.approx(saved["pici"]["compress"], rel=1e-9)
    assert got[0][1] * 3 == pytest.approx(saved["coo"]["accumulate"], rel=1e-9)


def _job_measure_links(rank, world, cache_dir):
    with _counting_probes(cache_dir) as calls:
        config = CollectiveConfig(ranks_per_node=1)
        measured = spccl_train.collectives.measure_links(config=config)
        x = torch.zeros(world * 3000)
        x[rank::31] = 1.0
        spccl_train.all_reduce(x, config=config)  # reuses what measure_links probed
        given = spccl_train.collectives.measure_links(config=CollectiveConfig(cost_model="default"))
    return len(calls), measured.links.inter is not None, measured.describe(), given.links, given.describe()


def test_measure_links_is_what_the_collectives_use(pools, tmp_path):
    got = pools(2).run(_job_measure_links, str(tmp_path))
    assert all(g[:2] == got[0][:2] for g in got)
    probes, has_inter, described, given_links, given_described = got[0]
    assert probes == 1 and has_inter  # one node per rank: the probe saw an inter-node link
    assert "GB/s" in described and "Pici encode" in described
    assert given_links is None and "links not measured (default:cpu)" in given_described


# --------------------------------------------------------------------------- the update rule


def test_a_far_miss_moves_the_factor_halfway_and_a_near_one_does_not():
    import random

    rng = random.Random()
    predicted = rng.uniform(1e-3, 1.0)
    # A steady miss, either way, far enough (> FAR**2) that the first correction leaves it far too.
    error = rng.choice([rng.uniform(1.6, 12.0), 1 / rng.uniform(1.6, 12.0)])
    c = feedback.Corrections()
    nbytes = rng.choice([64, 256, 1024]) << 20

    def observe(measured_s: float, times: list[int] | None = None) -> bool:
        c.called("all_reduce", "ring/pici", nbytes, predicted, Stopped(measured_s))
        return c.learn(times if times is not None else [c.report(), round(measured_s * 1e9 * 0.5)])

    assert not observe(predicted * error)  # the first observation of a kind is warm-up
    factors = []
    for _ in range(8):
        observe(predicted * error)
        factors.append(c.factors_for("all_reduce", nbytes).get("ring/pici", 1.0))
    # halfway in log space each time: error**(1/2), error**(3/4), ... until within FAR: then no change
    want = [error ** (1 - 0.5**k) for k in (1, 2)]
    assert factors[:2] == pytest.approx(want, rel=1e-5)  # times travel as whole nanoseconds
    assert factors[-1] == factors[-2] and abs(math.log(error / factors[-1])) <= math.log(feedback.FAR)
    version, revision = c.version, c.revision
    assert not observe(predicted * factors[-1] * 1.1)  # near its corrected prediction: kept
    assert c.revision == revision + 1  # an observation counted: what factors_for returns may move
    assert not observe(predicted * error, [-1, 5])  # a rank that had not finished: nothing learned
    assert c.version == version and c.revision == revision + 1
    # other sizes, collectives and element types have factors of their own
    assert c.factors_for("all_reduce", nbytes * 16) == {} and c.factors_for("all_gather", nbytes) == {}
    assert c.factors_for("all_reduce", nbytes, torch.bfloat16) == {}
    # factors stay in range however far the measurements are
    for _ in range(20):
        observe(predicted * 1e6)
    assert c.factors_for("all_reduce", nbytes)["ring/pici"] == feedback.FACTOR_RANGE[1]
    assert "all_reduce ring/pici" in c.describe()


def test_one_far_call_moves_nothing_and_two_in_a_row_do():
    import random

    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    nbytes, predicted = rng.choice([64, 256, 1024]) << 20, rng.uniform(1e-3, 1.0)
    kind = ("all_reduce", "direct/coo", feedback.size_class(nbytes), "float32")
    spike = rng.uniform(1.6, 20.0)

    def observe(c: feedback.Corrections, ratio: float) -> bool:
        c.called("all_reduce", "direct/coo", nbytes, predicted, Stopped(predicted * ratio), torch.float32)
        return c.learn([c.report()])

    # the first observation after the warm-up has no previous one and is learned from alone (the
    # warm-up's time is not a previous one: were it, this far call would be a lone outlier)
    first = feedback.Corrections()
    observe(first, rng.uniform(0.9, 1.1))
    assert observe(first, spike), f"seed {seed}"
    assert first.factors[kind] == pytest.approx(math.sqrt(spike), rel=1e-5), f"seed {seed}"

    c = feedback.Corrections()
    observe(c, rng.uniform(2.0, 9.0))  # warm-up: left out
    assert not observe(c, rng.uniform(0.9, 1.1)), f"seed {seed}"
    for lone in (spike, 1 / spike):  # a hiccup either way, between calls as predicted
        assert not observe(c, lone) and not observe(c, 1.0), f"seed {seed}"
        assert c.factors.get(kind, 1.0) == 1.0, f"seed {seed}"
    assert not observe(c, spike), f"seed {seed}"  # the first of two: alone so far
    assert observe(c, spike), f"seed {seed}"  # the second: the median of the two and the factor
    # halfway, in log space (times travel as whole nanoseconds)
    assert c.factors[kind] == pytest.approx(math.sqrt(spike), rel=1e-5), f"seed {seed}"


def test_unobserved_sparse_candidates_take_a_share_of_what_the_observed_ones_learned():
    import random

    c = feedback.Corrections()
    nbytes = 256 << 20
    errors = {"direct/pici": random.uniform(2.0, 8.0), "ring/coo": random.uniform(0.1, 0.5), "native/dense": 3.0}
    assert c.factors_for("all_reduce", nbytes) == {}
    learned = {}
    for name, error in errors.items():
        for _ in range(12):  # the first is warm-up; then halfway each time until within FAR
            c.called("all_reduce", name, nbytes, 0.01, Stopped(0.01 * error))
            c.learn([c.report()])
        learned[name] = c.factors_for("all_reduce", nbytes)[name]
        assert abs(math.log(error / learned[name])) <= math.log(feedback.FAR)
    factors = c.factors_for("all_reduce", nbytes)
    sparse = [math.log(learned[n]) for n in ("direct/pici", "ring/coo")]
    assert factors[feedback.UNOBSERVED] == pytest.approx(math.exp(sum(sparse) / 3))  # n / (n + 1) of the mean
    assert feedback.factor_of(factors, "direct/coo") == factors[feedback.UNOBSERVED]
    assert feedback.factor_of(factors, "ring/coo") == learned["ring/coo"]  # observed: its own
    assert feedback.factor_of(factors, "native/dense") == learned["native/dense"]
    assert feedback.factor_of(c.factors_for("all_reduce", nbytes * 4), "native/dense") == 1.0
    for size, dtype in ((nbytes, None), (nbytes * 4, None), (nbytes, torch.bfloat16)):  # the held calls' look-up
        want = feedback.factor_of(c.factors_for("all_reduce", size, dtype), "native/dense")
        assert c.own_factor(feedback.kind_of("all_reduce", "native/dense", size, dtype)) == want
    # the native call neither gives nor takes the share
    d = feedback.Corrections()
    for _ in range(6):
        d.called("all_reduce", "native/dense", nbytes, 0.01, Stopped(0.05))
        d.learn([d.report()])
    assert feedback.UNOBSERVED not in d.factors_for("all_reduce", nbytes)
    assert feedback.factor_of(d.factors_for("all_reduce", nbytes), "ring/pici") == 1.0
    # a kind observed for the first time starts learning from the share it was weighed with
    share = factors[feedback.UNOBSERVED]
    for _ in range(2):  # warm-up, then an observation at exactly its weighed prediction
        c.called("all_reduce", "direct/coo", nbytes, 0.01, Stopped(0.01 * share))
        c.learn([c.report()])
    assert c.factors_for("all_reduce", nbytes)["direct/coo"] == pytest.approx(share, rel=1e-6)


def test_runs_count_by_density_octave_and_a_trial_is_no_preference():
    c = feedback.Corrections()
    nbytes = 256 << 20
    c.called("all_reduce", "direct/coo", nbytes, 0.01, Stopped(0.01), torch.float32, "auto", trial=True)  # warm-up
    c.learn([c.report()])
    for octave in (-7, -7, -10):
        c.called("all_reduce", "direct/coo", nbytes, 0.01, Stopped(0.01), torch.float32, "auto", octave, trial=True)
        c.learn([c.report()])
    assert c.tried("all_reduce", nbytes, torch.float32, -7) == {"direct/coo"}  # TRIAL_RUNS of them
    assert c.tried("all_reduce", nbytes, torch.float32, -10) == frozenset()  # one run
    assert c.tried("all_reduce", nbytes * 4, torch.float32, -7) == frozenset()  # another size class
    assert c.tried("all_reduce", nbytes, torch.bfloat16, -7) == frozenset()
    assert c.last_run("all_reduce", nbytes, torch.float32, "auto") is None  # trials are not preferred
    c.called("all_reduce", "direct/pici", nbytes, 0.01, Stopped(0.01), torch.float32, "auto", -10)
    assert c.last_run("all_reduce", nbytes, torch.float32, "auto") == "direct/pici"
    # a run counts when it is made, observed or not (a rank's -1: nothing learned)
    c.learn([c.report(), -1])
    c.called("all_reduce", "direct/pici", nbytes, 0.01, Stopped(0.01), torch.float32, "auto", -10)
    assert c.tried("all_reduce", nbytes, torch.float32, -10) == {"direct/pici"}
    # calls that weighed nothing (no octave) are not counted
    c.called("all_reduce", "ring/pici", nbytes, 0.01, Stopped(0.01), torch.float32, "auto")
    c.called("all_reduce", "ring/pici", nbytes, 0.01, Stopped(0.01), torch.float32, "auto")
    assert "ring/pici" not in c.tried("all_reduce", nbytes, torch.float32, -10)


def test_a_kinds_warm_up_is_no_run_of_a_trial():
    """A trial judged on one observation is judged on its noise: the run that was its kind's
    warm-up (observed, taught nothing) is not counted, so a trial of a new kind takes one run
    more; a warm-up that was not observed is not known as one, and the next observed run is."""
    c = feedback.Corrections()
    nbytes = 64 << 20

    def run(candidate, observed=True):
        c.called("all_reduce", candidate, nbytes, 0.01, Stopped(0.01), torch.float32, "auto", -7, trial=True)
        c.learn([c.report() if observed else -1])
        return "tried" if candidate in c.tried("all_reduce", nbytes, torch.float32, -7) else "not yet"

    assert [run("direct/coo") for _ in range(3)] == ["not yet", "not yet", "tried"]
    assert [run("ring/coo", observed=False), run("ring/coo"), run("ring/coo")] == ["not yet", "not yet", "tried"]
    assert [run("direct/pici"), run("direct/pici", observed=False)] == ["not yet", "not yet"]
    assert run("direct/pici") == "tried"  # at most TRIAL_RUNS + 1 runs, observed or not
    # a kind warmed up elsewhere (another octave) is tried in TRIAL_RUNS runs here
    c.called("all_reduce", "ring/pici", nbytes, 0.01, Stopped(0.01), torch.float32, "auto", -3)
    c.learn([c.report()])
    assert [run("ring/pici") for _ in range(2)] == ["not yet", "tried"]


def test_at_an_octave_a_kind_is_weighed_by_what_it_took_there():
    """The least of the last LOCAL_CALLS observations at an octave, to 1/16 of an octave, the
    kind's warm-up left out; other octaves keep the kind's factor."""
    import random

    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    c = feedback.Corrections()
    nbytes = 64 << 20

    def observe(ratio: float, octave: int | None) -> None:
        c.called("all_reduce", "direct/coo", nbytes, 0.01, Stopped(0.01 * ratio), torch.float32, "auto", octave)
        c.learn([c.report()])

    def weighed(ratios: list[float]) -> float:  # as learn sees them (whole nanoseconds), then rounded
        least = min(round(0.01 * r * 1e9) / 1e9 / 0.01 for r in ratios)
        return 2.0 ** (round(16 * math.log2(least)) / 16)

    observe(9.0, -7)  # the kind's warm-up: nowhere
    assert c.factors_for("all_reduce", nbytes, torch.float32, -7) == {}
    ratios = [rng.uniform(0.5, 0.9) for _ in range(5)]
    for k, r in enumerate(ratios, 1):
        observe(r, -7)
        got = c.factors_for("all_reduce", nbytes, torch.float32, -7)["direct/coo"]
        assert got == weighed(ratios[max(0, k - feedback.LOCAL_CALLS) : k]), f"seed {seed}"
    # elsewhere, the kind's own factor (learned from all of them)
    kind = c.factors_for("all_reduce", nbytes, torch.float32)["direct/coo"]
    assert c.factors_for("all_reduce", nbytes, torch.float32, -10)["direct/coo"] == kind
    assert c.factors_for("all_reduce", nbytes, torch.bfloat16, -7) == {}
    assert c.least_local("all_reduce", nbytes, torch.float32) == got  # the held calls' bound
    assert c.least_local("all_reduce", nbytes * 4, torch.float32) is None
    observe(5.0, None)  # a call without an octave (with bounds) is no octave's
    assert c.factors_for("all_reduce", nbytes, torch.float32, -7)["direct/coo"] == got


def test_stalled_calls_raise_a_figure_only_three_in_a_row():
    """Noise only slows a call: two stalls among a candidate's last three calls at an octave leave
    its figure where its fast call put it (a left candidate keeps its figure, so one raised by two
    stalls was lost for good); three slow calls in a row raise it."""
    c = feedback.Corrections()
    nbytes = 256 << 20

    def observe(ratio: float) -> float:
        c.called("all_reduce", "direct/pici", nbytes, 0.01, Stopped(0.01 * ratio), torch.float32, "auto", -3)
        c.learn([c.report()])
        return c.factors_for("all_reduce", nbytes, torch.float32, -3).get("direct/pici", 1.0)

    observe(1.0)  # the kind's warm-up
    assert [observe(r) for r in (1.0, 1.6, 1.6)] == [1.0, 1.0, 1.0]
    assert observe(1.6) == 2.0 ** (round(16 * math.log2(1.6)) / 16)  # three in a row
    assert observe(0.9) == 2.0 ** (round(16 * math.log2(0.9)) / 16)  # one fast call brings it back


def test_a_candidate_left_for_refresh_calls_is_tried_again_and_its_fast_call_takes_it_back():
    """Three stalls in a row leave a candidate with a raised figure; once REFRESH_CALLS calls at the
    octave passed without it, it counts as untried there (one trial call), and a fast call then
    brings its figure back down. A candidate still running never goes stale."""
    c = feedback.Corrections()
    nbytes, octave = 1 << 30, -10

    def run(candidate: str, ratio: float = 1.0) -> None:
        c.called("all_reduce", candidate, nbytes, 0.01, Stopped(0.01 * ratio), torch.float32, "auto", octave)
        c.learn([c.report()])

    def tried() -> frozenset[str]:
        return c.tried("all_reduce", nbytes, torch.float32, octave)

    for ratio in (1.0, 1.0, 1.5, 1.5, 1.5):  # warm-up, a fast call, three stalls: left
        run("direct/pici", ratio)
    for _ in range(3):
        run("direct/coo", 1.2)
    raised = c.factors_for("all_reduce", nbytes, torch.float32, octave)["direct/pici"]
    assert raised == 2.0 ** (round(16 * math.log2(1.5)) / 16)
    for _ in range(feedback.REFRESH_CALLS - 4):
        run("direct/coo", 1.2)
    assert tried() == {"direct/pici", "direct/coo"}  # the last direct/pici run was REFRESH_CALLS - 1 calls ago
    run("direct/coo", 1.2)
    assert tried() == {"direct/coo"}
    # ran_at forgets no run: a standing choice far from the winner is tried here once, not every
    # REFRESH_CALLS calls (choice.TRIAL_MARGIN)
    assert c.ran_at("all_reduce", nbytes, torch.float32, octave) == {"direct/pici", "direct/coo"}
    assert c.ran_at("all_reduce", nbytes, torch.float32, octave + 1) == frozenset()
    run("direct/pici", 1.0)  # the trial: fast again
    assert tried() == {"direct/pici", "direct/coo"}
    assert c.factors_for("all_reduce", nbytes, torch.float32, octave)["direct/pici"] == 1.0


def test_a_calls_factors_come_from_its_own_group_of_kinds():
    """factors_for, least_local and the share of the unobserved walk only the kinds of the call's
    collective, size class and element type: the same figures as a walk over every kind seen."""
    import random

    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    c = feedback.Corrections()
    names = ["direct/pici", "direct/coo", "ring/pici", "ring/coo", feedback.NATIVE]
    shapes = [(col, nbytes, dt) for col in ("all_reduce", "all_gather") for nbytes in (1 << 20, 64 << 20)
              for dt in (torch.float32, torch.bfloat16)]  # fmt: skip
    for _ in range(400):
        col, nbytes, dt = rng.choice(shapes)
        octave = rng.choice([None, -3, -7])
        c.called(col, rng.choice(names), nbytes, 0.01, Stopped(0.01 * rng.uniform(0.3, 3.0)), dt, "auto", octave)
        c.learn([c.report()])

    def brute_factors(col, nbytes, dt, octave):  # every kind seen, filtered
        size, of = feedback.size_class(nbytes), str(dt).removeprefix("torch.")
        group = [k for k, n in c.seen.items() if n > 1 and (k[0], k[2], k[3]) == (col, size, of)]
        own = {k[1]: c.factors.get(k, 1.0) for k in group}
        sparse = [math.log(c.factors.get(k, 1.0)) for k in group if k[1] not in feedback.OWN_ONLY]
        if sparse:
            own[feedback.UNOBSERVED] = math.exp(sum(sparse) / (len(sparse) + 1))
        for name, ratios in c.local.get((col, size, of, octave), {}).items():
            own[name] = feedback._local_factor(ratios)
        least = [feedback._local_factor(r) for (cc, s, o, _), by in c.local.items() if (cc, s, o) == (col, size, of)
                 for name, r in by.items() if name not in feedback.OWN_ONLY]  # fmt: skip
        return own, min(least) if least else None

    for col, nbytes, dt in shapes:
        for octave in (None, -3, -7):
            own, least = brute_factors(col, nbytes, dt, octave)
            assert c.factors_for(col, nbytes, dt, octave) == own, f"seed {seed}"
            assert c.least_local(col, nbytes, dt) == least, f"seed {seed}"


def test_the_slowest_rank_is_the_calls_time():
    c = feedback.Corrections()
    for times in ([1, 1], [4_000_000_000, 1]):
        c.called("all_gather", "direct/coo", 1 << 20, 1.0, Stopped(1.0))
        c.learn(times)
    assert c.factors_for("all_gather", 1 << 20)["direct/coo"] == pytest.approx(2.0)  # halfway to 4 s / 1 s


def _job_learns(rank, world, cache_dir, slow):
    """Calls take what the model predicted (the ranks within 10% of each other), except that
    candidate ``slow`` takes 50x that: ``auto`` must learn to leave it, identically on every rank.
    ``slow="first"``: whichever candidate the first call ran (the links are measured afresh by
    each run, so two runs may weigh a near tie apart)."""
    os.environ["SPCCL_CACHE_DIR"] = cache_dir
    links.forget_measured()
    real = feedback.Corrections.report
    chosen, trials = [], []
    slow_kind = [None if slow == "first" else slow]

    def report(self):
        pending = self._pending
        if pending is None:
            return -1
        if slow_kind[0] is None:
            slow_kind[0] = pending.kind[1]
        took = pending.predicted_s * 1e9 * (1 + 0.1 * rank)
        return round(50 * took if pending.kind[1] == slow_kind[0] else took)

    feedback.Corrections.report = report
    try:
        group = dist.new_group()  # corrections of its own
        config = CollectiveConfig(ranks_per_node=1)
        x = torch.zeros(world * 40_000)
        x[rank::50] = 1.0
        for _ in range(8):
            spccl_train.all_reduce(x.clone(), group=group, config=config)
            chosen.append(f"{last_stats().algorithm}/{last_stats().format.value}")
            trials.append(last_stats().trial)
        learned = spccl_train.collectives.learned_corrections(group)
        return chosen, dict(learned.factors), learned.version, trials
    finally:
        feedback.Corrections.report = real


def test_auto_leaves_a_candidate_that_runs_far_slower_than_predicted(pools, tmp_path):
    # untaught (every call as predicted), auto keeps its pick; near-tied candidates are tried in
    # its place, twice each
    first = pools(2).run(_job_learns, str(tmp_path), "none/none")
    assert all(g == first[0] for g in first), "ranks chose differently"
    chosen, _, _, trials = first[0]
    picks = {name for name, trial in zip(chosen, trials) if not trial}
    tried = [name for name, trial in zip(chosen, trials) if trial]
    assert len(picks) == 1 and picks.isdisjoint(tried), first
    # each at most twice, and once more for its kind's warm-up; fewer where what a call taught put
    # it beyond the trial margin (the calls take up to 1.1x their prediction, and where the margin's
    # edge lies depends on the links this run measured; the exact count is
    # test_a_kinds_warm_up_is_no_run_of_a_trial's)
    assert all(tried.count(name) <= feedback.TRIAL_RUNS + 1 for name in tried), first
    # taught that its first pick is slow, it leaves it
    got = pools(2).run(_job_learns, str(tmp_path), "first")
    assert all(g == got[0] for g in got), "ranks learned differently"
    chosen, factors, version, _ = got[0]
    slow = chosen[0]
    assert chosen[-1] != slow, chosen
    assert version > 0 and any(name == slow and f > 1 for (_, name, _, _), f in factors.items()), factors


def _job_tries(rank, world, cache_dir):
    """Every candidate takes what the model predicts (uncorrected), except the runner-up of the
    first weighing, which takes a twentieth of the choice's prediction: ``auto`` must try it, learn,
    and keep it. TRIAL_MARGIN is widened so that whatever the links measure, it is near; the
    config is Pici (ring or direct), so that no native call is weighed."""
    from spccl_train.collectives import choice as choice_module

    os.environ["SPCCL_CACHE_DIR"] = cache_dir
    links.forget_measured()
    real, margin = feedback.Corrections.report, choice_module.TRIAL_MARGIN
    choice_module.TRIAL_MARGIN = 100.0
    fast = {}

    def report(self):
        pending = self._pending
        if pending is None:
            return -1
        if pending.kind[1] == fast["name"]:
            return round(fast["took"] * 1e9)
        return round(pending.predicted_s * 1e9 * (1 + 0.05 * rank))

    feedback.Corrections.report = report
    try:
        group = dist.new_group()
        config = CollectiveConfig(ranks_per_node=1, format="pici")
        x = torch.zeros(world * 40_000)
        x[rank::50] = 1.0
        calls = []
        for _ in range(12):
            spccl_train.all_reduce(x.clone(), group=group, config=config)
            stats = last_stats()
            if not fast:  # the model's runner-up, which the first call should have tried
                sparse = sorted((t, n) for n, t in stats.candidates.items() if n != "native/dense")
                fast.update(name=sparse[1][1], took=sparse[0][0] / 20)
            calls.append((stats.algorithm + "/" + stats.format.value, stats.trial))
        return calls, fast["name"], dict(spccl_train.collectives.learned_corrections(group).factors)
    finally:
        feedback.Corrections.report = real
        choice_module.TRIAL_MARGIN = margin
        choice_module.clear_decisions()  # made under the widened margin


def test_auto_tries_a_near_tie_it_would_never_run_and_keeps_it_when_faster(pools, tmp_path):
    got = pools(3).run(_job_tries, str(tmp_path))
    assert all(g == got[0] for g in got), "ranks tried or learned differently"
    calls, fast, factors = got[0]
    # tried from the first call (its kind's warm-up, then once: seen fast, it is the choice)
    assert calls[:2] == [(fast, True)] * 2, calls
    assert fast not in [name for name, trial in calls[2:] if trial], calls  # and then no more
    trials = [name for name, trial in calls if trial]
    assert all(trials.count(name) <= feedback.TRIAL_RUNS + 1 for name in trials), calls
    assert calls[-3:] == [(fast, False)] * 3, calls  # learned: it is kept
    assert any(name == fast and f < 1 for (_, name, _, _), f in factors.items()), factors


def test_the_fit_grows_past_a_slow_start_up(monkeypatch):
    """Over sockets a tiny call takes tens of milliseconds and jitters by milliseconds: the large
    transfer must take several times as long as the tiny one, or its slope is the jitter."""
    start_up, rate = 50e-3, 0.6e9
    sizes = []

    def make(nbytes):
        sizes.append(nbytes)
        jitter = 2e-3 if nbytes > links._SMALL else 0.0  # a tiny call that happened to run fast
        return lambda: start_up + jitter + nbytes / rate

    monkeypatch.setattr(links, "_times", lambda transport, device, step, repeats: [step()])
    monkeypatch.setattr(links, "_slowest", lambda transport, device, seconds: seconds)
    latency, bandwidth = links._fit(None, torch.device("cuda"), make, pushed=lambda n: n, long_enough=10e-3)
    # 1 MiB took 54 ms (> 10 ms), 4 MiB 59 ms, 16 MiB 80 ms, 64 MiB 164 ms, 256 MiB 499 ms (> 4 x 50 ms)
    assert max(sizes) == 256 << 20
    assert latency == pytest.approx(start_up, rel=1e-3) and bandwidth == pytest.approx(rate, rel=0.02)


@pytest.mark.parametrize("delayed", [0, 1, 2])
def test_the_fit_takes_each_sizes_fastest_repeat(monkeypatch, delayed):
    """A shared socket only ever delays a transfer: repeats that waited for someone else's traffic
    (here none, one or two of the three, at every size) leave the fitted link as it is."""
    start_up, rate, repeats = 3e-3, 1.3e9, []

    def make(nbytes):
        return lambda: start_up + nbytes / rate

    def times(transport, device, step, n):
        repeats.append(n)
        base = step()
        return [base * (5 if i < delayed else 1) for i in range(n)][::-1]

    monkeypatch.setattr(links, "_times", times)
    monkeypatch.setattr(links, "_slowest", lambda transport, device, seconds: seconds)
    latency, bandwidth = links._fit(None, torch.device("cuda"), make, pushed=lambda n: n)
    assert set(repeats) == {links._REPEATS} and delayed < links._REPEATS
    assert latency == pytest.approx(start_up, rel=1e-3) and bandwidth == pytest.approx(rate, rel=1e-6)


def test_element_types_learn_apart():
    """A bf16 call and an fp32 one of the same bytes (and collective) are different kinds: the
    codecs' speed per byte differs, and the model is calibrated on fp32."""
    c = feedback.Corrections()
    nbytes = 256 << 20
    for _ in range(3):  # fp32 calls run 4x their prediction
        c.called("all_reduce", "direct/pici", nbytes, 0.01, Stopped(0.04), torch.float32)
        c.learn([c.report()])
    fp32 = c.factors_for("all_reduce", nbytes, torch.float32)
    assert fp32["direct/pici"] > feedback.FAR and feedback.UNOBSERVED in fp32
    assert c.factors_for("all_reduce", nbytes, torch.bfloat16) == {}
    assert c.last_run("all_reduce", nbytes, torch.float32) == "direct/pici"
    assert c.last_run("all_reduce", nbytes, torch.bfloat16) is None
    c.called("all_reduce", "ring/coo", nbytes, 0.01, Stopped(0.01), torch.bfloat16)
    c.learn([c.report()])  # a bf16 kind's warm-up starts from the bf16 share (none), not fp32's
    c.called("all_reduce", "ring/coo", nbytes, 0.01, Stopped(0.01), torch.bfloat16)
    c.learn([c.report()])
    assert c.factors_for("all_reduce", nbytes, torch.bfloat16) == {"ring/coo": 1.0, feedback.UNOBSERVED: 1.0}
    assert "float32" in c.describe() and "bfloat16" not in c.describe()
