"""The training plugin on CPU: configs, offline data, the gloo DDP trainer, the report command."""

import csv
import json
import math
import os
import pathlib
import random
import socket

import pytest
import torch

from spccl_train import cli
from spccl_train.train import config as C
from spccl_train.train import trainer as T
from spccl_train.train.data import DataError, TokenData, embedded_corpus, prepare_tokens
from spccl_train.train.report import BREAKDOWN, default_report_path, load_run, report_table

EMULATION_VARIABLES = (
    "NCCL_HOSTID",
    "SPCCL_RANKS_PER_NODE",
    "SPCCL_EMULATED_NODES",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_NVLS_ENABLE",
    "GLOO_SOCKET_IFNAME",
)
from spccl_train.train.trainer import launch, local_rendezvous

pytest.importorskip("transformers")
pytest.importorskip("datasets")


# --------------------------------------------------------------------------- configs


def test_every_shipped_config_loads_and_opens_with_its_command():
    shipped = C.shipped_configs()
    assert {"tiny_cpu", "gpt2_xl_dense", "gpt2_xl_spccl", "starcoder2_dense", "starcoder2_spccl"} <= set(shipped)
    for name, path in shipped.items():
        cfg = C.load_config(str(path))
        assert cfg.spccl.enabled == (not name.endswith("_dense")), name
        head = path.read_text().splitlines()[0]
        assert head.startswith(f"# {name}:"), head
        assert "spccl-train" in path.read_text() or "spccl_train.cli" in path.read_text()


def test_default_is_tiny_cpu_with_spccl_on_two_gloo_ranks():
    cfg = C.load_config(None)
    assert (cfg.dist.nproc_per_node, cfg.dist.backend, cfg.train.device, cfg.spccl.enabled) == (2, "gloo", "cpu", True)
    # the recommended recipe (README): BurstAdamW, leak-free error feedback, a density warm-up
    assert (cfg.optim.name, cfg.spccl.pruning.decay) == ("burst_adamw", 1.0) and cfg.spccl.pruning.warmup_steps > 0


def test_megatron_engine_says_the_default_optimizer_is_not_its_own(capsys):
    assert cli.main(["--engine", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "optim.name='burst_adamw' (config tiny_cpu) applies to --engine ddp only" in err
    assert "add optim.name=adamw" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus: 1\n", "unknown key 'bogus' in the config"),
        ("model: {layers: 3}\n", "unknown key 'model.layers' in model: known keys are arch, n_layer"),
        ("train: {iterations: ten}\n", "train.iterations='ten': expected an integer"),
        ("train: {iterations: 0}\n", "train.iterations=0: must be >= 1"),
        (
            "spccl: {collective: {format: zip}}\n",
            "spccl.collective.format='zip': expected one of auto, pici, coo, dense",
        ),
        ("spccl: {pruning: {density: 0}}\n", "spccl.pruning.density=0.0: must be > 0.0"),
        ("spccl: {prune: 1}\n", "spccl.prune=1: expected true or false"),
        ("spccl: {density: 0.01}\n", "unknown key 'spccl.density' in spccl: known keys are enabled, prune, pruning"),
        ("spccl: {pruning: {warmup_steps: -1}}\n", "spccl.pruning.warmup_steps=-1: must be >= 0"),
        ("spccl: {pruning: {warmup_steps: 2.5}}\n", "spccl.pruning.warmup_steps=2.5: expected an integer"),
        ("spccl: {capacity_factor: 0.5}\n", "spccl.capacity_factor=0.5: use 0 (plan from exchanged counts)"),
        ("spccl: {capacity_factor: 2, prune: false}\n", "spccl.capacity_factor needs spccl.prune=true"),
        (
            "spccl: {collective: {cuda_graphs: true}}\n",
            "spccl.collective.cuda_graphs=true needs spccl.capacity_factor >= 1",
        ),
        ("model: 3\n", "model: expected a mapping"),
        ("data: {seq_len: 4096}\n", "data.seq_len=4096 exceeds model.max_position=1024"),
        ("train: {iterations: 10, warmup_iterations: 10}\n", "train.warmup_iterations=10 leaves no iteration"),
        ("data: {paths: a.txt}\n", "data.paths='a.txt': expected a list of strings"),
        ("- a\n- b\n", "expected a mapping at the top level"),
    ],
)
def test_config_errors_name_the_key_and_the_fix(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(C.ConfigError) as err:
        C.load_config(str(path))
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_overrides_parse_yaml_values_and_reject_unknown_keys():
    cfg = C.load_config("tiny_cpu", ["train.iterations=30", "spccl.enabled=false", "data.paths=[a.txt, b.txt]"])
    assert (cfg.train.iterations, cfg.spccl.enabled, cfg.data.paths) == (30, False, ["a.txt", "b.txt"])
    assert C.load_config("tiny_cpu", ["optim.lr=1"]).optim.lr == 1.0  # ints widen to floats
    assert C.load_config("tiny_cpu", ["spccl.overlap=on"]).spccl.overlap == "on"  # YAML reads on as true
    with pytest.raises(C.ConfigError, match="unknown key 'train.iters'"):
        C.load_config("tiny_cpu", ["train.iters=3"])
    with pytest.raises(C.ConfigError, match="expected dotted.key=value"):
        C.load_config("tiny_cpu", ["train.iterations"])
    with pytest.raises(C.ConfigError, match="is a value, not a section"):
        C.load_config("tiny_cpu", ["train.iterations.x=3"])
    with pytest.raises(C.ConfigError, match="not found"):
        C.load_config("no_such_config")


def test_config_round_trips_through_plain_data():
    cfg = C.load_config("gpt2_xl_spccl", ["spccl.pruning.decay=0.5"])
    assert C.from_dict(C.to_dict(cfg)) == cfg


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert cli.main(["--config", "tiny_cpu", "train.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "config error:" in err and "with overrides train.bogus=1: unknown key 'train.bogus'" in err


# --------------------------------------------------------------------------- data


def _data_cfg(tmp_path: pathlib.Path, **kw) -> C.DataConfig:
    return C.DataConfig(cache_dir=str(tmp_path / "cache"), seq_len=16, tokenizer_vocab_size=300, **kw)


def test_embedded_corpus_is_deterministic_and_sized():
    a, b = embedded_corpus(50_000), embedded_corpus(50_000)
    assert a == b and 50_000 <= len(a) < 52_000
    assert embedded_corpus(50_000, seed=1) != a


def test_local_text_files_are_tokenized_offline_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(embedded_corpus(30_000, seed=2))
    (corpus / "b.md").write_text(embedded_corpus(30_000, seed=3))
    (corpus / "ignored.bin").write_bytes(b"\x00\x01")
    cfg = _data_cfg(tmp_path, source="files", paths=[str(corpus)])
    data = prepare_tokens(cfg)
    assert data.meta["files"] == [str(corpus / "a.txt"), str(corpus / "b.md")]
    assert data.tokens.numel() > 5_000 and 256 < data.vocab_size <= 300
    assert int(data.tokens.min()) >= 0 and int(data.tokens.max()) < data.vocab_size
    tok_files = sorted((tmp_path / "cache").glob("tokens-*.bin"))
    stamp = tok_files[0].stat().st_mtime_ns
    again = prepare_tokens(cfg)  # served from the cache
    assert torch.equal(again.tokens, data.tokens) and tok_files[0].stat().st_mtime_ns == stamp
    (corpus / "a.txt").write_text(embedded_corpus(30_000, seed=4))  # changed file: new cache entry
    assert not torch.equal(prepare_tokens(cfg).tokens, data.tokens)


def test_wikitext_folder_layout_is_found(tmp_path):
    root = tmp_path / "wikitext-103-raw"
    root.mkdir()
    (root / "wiki.train.raw").write_text(" = Valkyria = \n\n" + embedded_corpus(20_000, seed=5))
    (root / "wiki.valid.raw").write_text("not the training split\n")
    data = prepare_tokens(_data_cfg(tmp_path, source="wikitext103", paths=[str(tmp_path)]))
    assert data.meta["files"] == [str(root / "wiki.train.raw")]


def test_missing_data_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DataError, match="does not exist"):
        prepare_tokens(_data_cfg(tmp_path, source="files", paths=[str(tmp_path / "nope.txt")]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no WikiText-103 training split"):
        prepare_tokens(_data_cfg(tmp_path, source="wikitext103", paths=[str(tmp_path / "empty")]))
    with pytest.raises(DataError, match="set data.paths"):
        prepare_tokens(_data_cfg(tmp_path, source="wikitext103"))
    with pytest.raises(DataError, match="no tokenizer.json"):
        prepare_tokens(_data_cfg(tmp_path, tokenizer=str(tmp_path / "empty"), embedded_bytes=10_000))


def test_batches_are_deterministic_windows():
    tokens = torch.arange(1000, dtype=torch.int32)
    data = TokenData(tokens, seq_len=10, vocab_size=1000, eos_id=0, meta={})
    a = data.batch(step=3, rank=1, world=2, micro_batch=4, seed=7)
    assert a.shape == (4, 11) and torch.equal(a, data.batch(step=3, rank=1, world=2, micro_batch=4, seed=7))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 10, dtype=torch.long))  # contiguous windows
    assert not torch.equal(a, data.batch(step=3, rank=0, world=2, micro_batch=4, seed=7))
    with pytest.raises(DataError, match="fewer than data.seq_len"):
        TokenData(tokens[:5], seq_len=10, vocab_size=1000, eos_id=0, meta={})


# --------------------------------------------------------------------------- training


def _tiny(tmp_path: pathlib.Path, name: str, *extra: str) -> C.ExperimentConfig:
    return C.load_config(
        "tiny_cpu",
        [
            "model.n_layer=1",
            "model.hidden=32",
            "model.n_head=2",
            "model.vocab_size=512",
            "model.max_position=32",
            "data.seq_len=32",
            "data.tokenizer_vocab_size=512",
            "data.embedded_bytes=60000",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.iterations=6",
            "train.warmup_iterations=2",
            "train.micro_batch_size=2",
            f"output.dir={tmp_path / 'runs'}",
            f"output.name={name}",
            "output.progress=false",
            # Six iterations: no room for the default's density warm-up, prune to 1% at once.
            "spccl.pruning.warmup_steps=0",
            *extra,
        ],
    )


def _column(run_dir: pathlib.Path, name: str) -> list[float]:
    lines = (run_dir / "iterations.csv").read_text().splitlines()
    col = lines[0].split(",").index(name)
    return [float(line.split(",")[col]) for line in lines[1:]]


def _text_column(run_dir: pathlib.Path, name: str) -> list[str]:
    with open(run_dir / "iterations.csv", newline="") as f:
        return [row[name] for row in csv.DictReader(f)]


def _losses(run_dir: pathlib.Path) -> list[float]:
    return _column(run_dir, "loss")


def test_training_two_gloo_ranks_dense_and_spccl(tmp_path):
    dense = launch(
        _tiny(tmp_path, "dense", "spccl.enabled=false", "output.plot=false", "output.calls=true"), "tiny_cpu"
    )
    exact = launch(
        _tiny(tmp_path, "exact", "spccl.prune=false", "spccl.collective.format=pici", "output.plot=false"), "tiny_cpu"
    )
    pruned = launch(_tiny(tmp_path, "pruned", "spccl.collective.format=coo", "output.calls=true"), "tiny_cpu")
    # Pruning off: the sparse all-reduce is exact, and with two ranks a + b rounds the same in
    # any order, so the losses, and the reduced gradients' norms, equal dense DDP's bit for bit.
    assert _losses(exact) == _losses(dense)
    assert _column(exact, "grad_norm") == _column(dense, "grad_norm")
    assert all(0 < norm < math.inf for norm in _column(dense, "grad_norm"))
    assert all(0 < norm < math.inf for norm in _column(pruned, "grad_norm"))
    assert _losses(pruned)[0] == _losses(dense)[0] and _losses(pruned) != _losses(dense)
    s_dense = json.loads((dense / "summary.json").read_text())
    s_pruned = json.loads((pruned / "summary.json").read_text())
    # What ran, per iteration and summed over the summarised ones: COO where it was pinned, Pici
    # where it was, nothing on the dense run (nor on the pruned run's dense first iteration).
    assert s_dense["choices"] == {} and _text_column(dense, "choices") == [""] * 6
    chosen = _text_column(pruned, "choices")
    assert chosen[0] == "" and all(text.split(":")[0].endswith("/coo") for text in chosen[1:])
    assert sum(int(text.rsplit(":", 1)[1]) for text in chosen[2:]) == sum(s_pruned["choices"].values())
    assert all(name.endswith("/pici") for name in json.loads((exact / "summary.json").read_text())["choices"])
    # output.calls: each SpCCL reduction of each iteration (none in the dense first one), as the
    # iteration's totals count them; only where asked
    with open(pruned / "calls.csv", newline="") as f:
        calls = list(csv.DictReader(f))
    assert [int(c["iteration"]) for c in calls] == sorted(int(c["iteration"]) for c in calls)
    assert {int(c["iteration"]) for c in calls} == set(range(1, 6))
    assert all(c["candidate"] == "direct/coo" and c["encoded"] == "0" and c["trial"] == "0" for c in calls)
    assert all(float(c["time_ms"]) > 0 and float(c["predicted_ms"]) > 0 for c in calls)
    assert all(c["candidates_ms"].split()[0].startswith("direct/coo:") for c in calls)  # pinned: the one weighed
    sent = _column(pruned, "bytes_sent")
    for step in range(1, 6):
        assert sum(int(c["bytes_sent"]) for c in calls if int(c["iteration"]) == step) == sent[step]
    assert not (dense / "calls.csv").exists() and not (exact / "calls.csv").exists()  # no SpCCL; not asked
    assert (s_dense["mode"], s_dense["world_size"], s_dense["summarised_iterations"]) == ("dense", 2, 4)
    assert s_dense["bytes_ratio"] == 1.0 and s_dense["prune_ms"] == 0.0
    assert 0.005 < s_pruned["density"] < 0.05 and s_pruned["bytes_ratio"] < 0.2 and s_pruned["prune_ms"] > 0
    assert (pruned / "report.png").stat().st_size > 10_000
    out = tmp_path / "cmp.png"
    assert cli.main(["report", str(dense), str(pruned), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    for run, summary in ((dense, s_dense), (pruned, s_pruned)):
        _check_breakdown(run, summary)
        assert summary["device_line"] == "2 ranks on 1 x cpu" and summary["devices"] == 1
    # Pruning runs in line on CPU: its own row, and the hook's pruning time is all of it.
    assert s_pruned["breakdown_ms"]["prune_inline"] == pytest.approx(s_pruned["prune_ms"])
    assert s_dense["breakdown_ms"]["prune_inline"] == 0.0


def test_emulated_nodes_put_each_rank_on_a_node_and_measure_the_links(tmp_path, monkeypatch, capfd):
    # the emulation sets these in the process that calls it: restore them after the test
    for name in (*EMULATION_VARIABLES, "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("SPCCL_CACHE_DIR", str(tmp_path / "cache"))
    run = launch(
        _tiny(tmp_path, "emulated", "dist.emulate_nodes=2", "output.plot=false", "spccl.capacity_factor=4"), "tiny_cpu"
    )
    summary = json.loads((run / "summary.json").read_text())
    assert "inter-node" in summary["links"] and "intra-node" not in summary["links"], summary["links"]
    out = capfd.readouterr().out
    assert f"links: {summary['links']}" in out  # printed by rank 0
    assert out.count("spccl.capacity_factor=4 is set aside: the group spans nodes") == 1  # exact sizes on the wire
    assert summary["breakdown_ms"] is not None
    # a grouping that contradicts the emulation is refused before any rank starts training
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="dist.ranks_per_node=2 contradicts dist.emulate_nodes=2"):
        T.apply_emulation(_tiny(tmp_path, "bad", "dist.emulate_nodes=2", "dist.ranks_per_node=2"))


def _check_breakdown(run: pathlib.Path, summary: dict) -> None:
    """The parts of every iteration add up to it, the marked phases (all but ``other``) cover it,
    and the work each part names took time."""
    for row in load_run(run)[1]:
        parts = [row[f"{key}_s"] for key, _, _ in BREAKDOWN]
        assert all(part >= 0 for part in parts), row
        assert sum(parts) == pytest.approx(row["time_s"], rel=1e-6), row
        # "other" only closes the sum: the timer reads and the (CPU: empty) final synchronisation
        assert row["other_s"] < 0.02 * row["time_s"] + 1e-4, row
    ms = summary["breakdown_ms"]
    assert list(ms) == [key for key, _, _ in BREAKDOWN]
    assert sum(ms.values()) == pytest.approx(summary["iteration_ms"], rel=1e-6)
    assert min(ms["forward"], ms["backward"], ms["optimizer"], ms["comm_wait"]) > 0, ms
    text = T.format_summary(summary, run)
    for _, label, meaning in BREAKDOWN:
        assert label in text and meaning in text
    ran = "SpCCL reductions by the candidate that ran (summarised iterations): "
    assert (ran in text) == bool(summary["choices"])


def test_world_size_one_runs_in_process(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    run = launch(
        _tiny(
            tmp_path,
            "single",
            "dist.nproc_per_node=1",
            "train.iterations=3",
            "train.warmup_iterations=1",
            "optim.grad_clip=0",
        ),
        "tiny_cpu",
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and len(_losses(run)) == 3
    assert all(math.isnan(norm) for norm in _column(run, "grad_norm"))  # no clipping, no norm


def test_density_warm_up_reaches_the_hook(tmp_path, monkeypatch):
    """spccl.pruning.warmup_steps=3 after one dense iteration: density ramps 1, ~0.32, ~0.1, ~0.03, then 0.01."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = _tiny(
        tmp_path,
        "warm",
        "dist.nproc_per_node=1",
        "spccl.pruning.warmup_steps=3",
        "spccl.pruning.sample_fraction=0.2",
        "train.iterations=6",
        "train.warmup_iterations=4",
        "output.plot=false",
    )
    run = launch(cfg, "tiny_cpu")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    lines = (run / "iterations.csv").read_text().splitlines()
    col = lines[0].split(",").index("density")
    density = [float(line.split(",")[col]) for line in lines[1:]]
    scheduled = [1.0, 0.01**0.25, 0.1, 0.01**0.75, 0.01, 0.01]
    assert density[0] == 1.0  # the dense first iteration
    for got, want in zip(density[1:], scheduled[1:], strict=True):
        assert abs(got - want) <= 0.25 * want + 0.005, f"densities {density}, scheduled {scheduled}"
    assert C.load_config(str(run / "config.yaml")).spccl.pruning.warmup_steps == 3
    assert 0.005 < json.loads((run / "summary.json").read_text())["density"] < 0.02  # the last 2: density


def test_shipped_spccl_configs_finish_the_warm_up_before_the_timed_iterations():
    for name in ("tiny_cpu", "gpt2_xl_spccl", "starcoder2_spccl"):
        cfg = C.load_config(name)
        s, t = cfg.spccl, cfg.train
        assert s.pruning.warmup_steps > 0
        assert s.dense_iterations + s.pruning.warmup_steps <= t.warmup_iterations, name


# --------------------------------------------------------------------------- breakdown, devices, reports


def test_phase_breakdown_recovers_the_parts_of_a_random_iteration():
    """Build an iteration's timeline from known parts (random: buckets, compute between their
    hooks, pruning and transfers inside them, a final wait) and split it back."""
    rng = random.Random()
    for _ in range(200):
        seed = rng.randrange(2**32)
        r = random.Random(seed)
        data, forward, optimizer, other, wait = (r.uniform(0, 0.05) for _ in range(5))
        buckets = r.randint(0, 6)
        compute = [r.uniform(0, 0.05) for _ in range(buckets)]
        prune = [r.uniform(0, 0.01) * r.randint(0, 1) for _ in range(buckets)]
        comm = [r.uniform(0, 0.02) for _ in range(buckets)]
        now = data + forward
        spans = []
        for c, p, m in zip(compute, prune, comm, strict=True):
            now += c  # compute until the bucket is ready, then the hook runs
            spans.append((now, now + p + m))
            now += p + m
        if not buckets:
            compute, wait = [r.uniform(0, 0.05)], 0.0  # no hook: the backward pass is compute
            now += compute[0]
        backward_end = now + wait
        step_end = backward_end + optimizer
        wall = step_end + other
        parts = T.phase_breakdown(data, data + forward, backward_end, step_end, wall, spans, sum(prune))
        want = {
            "data": data,
            "forward": forward,
            "backward": sum(compute),
            "comm_wait": sum(comm) + wait,
            "prune_inline": sum(prune),
            "optimizer": optimizer,
            "other": other,
        }
        assert list(parts) == [key for key, _, _ in BREAKDOWN]
        assert parts == pytest.approx(want, abs=1e-9), f"seed {seed}"
        assert math.fsum(parts.values()) == pytest.approx(wall, abs=1e-9), f"seed {seed}"
    # Pruning that ran off the training stream or thread is no part of the wait: 0 in line.
    parts = T.phase_breakdown(0.0, 1.0, 4.0, 5.0, 5.0, [(2.0, 2.5)], 0.0)
    assert (parts["prune_inline"], parts["comm_wait"], parts["backward"]) == (0.0, 2.0, 1.0)


def test_device_line_counts_distinct_devices_not_ranks():
    rng = random.Random()
    hosts = [f"node{i}" for i in range(rng.randint(1, 3))]
    gpus = rng.randint(1, 4)
    per_gpu = rng.randint(1, 3)
    # the same GPU index on every host, several ranks per GPU: devices are (host, UUID) pairs
    ranks = [(h, f"GPU-{h}-{g}", "NVIDIA H200") for h in hosts for g in range(gpus) for _ in range(per_gpu)]
    rng.shuffle(ranks)
    n, devices = len(ranks), len(hosts) * gpus
    want = f"{n} x NVIDIA H200" if per_gpu == 1 else f"{n} ranks on {devices} x NVIDIA H200"
    assert T.describe_devices(ranks) == want, ranks
    assert T.describe_devices([("h", "GPU-a", "NVIDIA H200")] * 2) == "2 ranks on 1 x NVIDIA H200"
    assert T.describe_devices([("h", "GPU-a", "NVIDIA H200"), ("h", "GPU-b", "NVIDIA H200")]) == "2 x NVIDIA H200"
    mixed = [("h", "GPU-a", "NVIDIA H200"), ("h", "GPU-b", "NVIDIA H100"), ("h", "GPU-b", "NVIDIA H100")]
    assert T.describe_devices(mixed) == "1 x NVIDIA H200 + 2 ranks on 1 x NVIDIA H100"
    host, ident, name = T.device_identity(torch.device("cpu"))
    assert (host, ident, name) == (socket.gethostname(), "cpu", "cpu")
    assert T.describe_devices([T.device_identity(torch.device("cpu"))] * 2) == "2 ranks on 1 x cpu"


def _fake_run(root: pathlib.Path, name: str, mode: str, broken_down: bool = True) -> pathlib.Path:
    """A finished run folder (summary.json, iterations.csv, its own report.png) from random records."""
    rng = random.Random()
    records = []
    for i in range(6):
        parts = {f"{key}_s": rng.uniform(0.001, 0.02) if broken_down else math.nan for key, _, _ in BREAKDOWN}
        time_s = sum(parts.values()) if broken_down else rng.uniform(0.01, 0.1)
        records.append(
            T.IterationRecord(
                iteration=i,
                time_s=time_s,
                allreduce_s=0.01,
                prune_s=0.0,
                loss=8.0 - i * rng.random(),
                lr=1e-3,
                density=1.0,
                bytes_sent=100,
                dense_bytes=100,
                **parts,
            )
        )
    info = {"config_name": "tiny_cpu", "mode": mode, "world_size": 2, "device": "cpu", "tokens_per_iteration": 64}
    run = root / name
    run.mkdir(parents=True)
    T._write_run(run, records, T.summarize(records, 2, info))
    (run / "report.png").write_bytes(os.urandom(64))
    return run


def test_report_writes_its_own_file_and_leaves_the_runs_alone(tmp_path, monkeypatch, capsys):
    dense = _fake_run(tmp_path / "runs", "tiny_cpu-dense-1", "dense")
    sparse = _fake_run(tmp_path / "runs", "tiny_cpu-spccl-1", "spccl", broken_down=False)  # e.g. Megatron's
    own = {run: (run / "report.png").read_bytes() for run in (dense, sparse)}
    cwd = tmp_path / "here"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert cli.main(["report", str(dense), str(sparse)]) == 0
    out = cwd / "compare-tiny_cpu-dense-1-vs-tiny_cpu-spccl-1.png"
    assert f"plot: {out.relative_to(cwd)}" in capsys.readouterr().out
    assert out.stat().st_size > 10_000
    assert {run: (run / "report.png").read_bytes() for run in own} == own  # untouched
    assert sorted(p.name for p in dense.iterdir()) == ["iterations.csv", "report.png", "summary.json"]
    # runs of one name from two parents, and many runs, still get names of their own
    other = _fake_run(tmp_path / "elsewhere", "tiny_cpu-dense-1", "dense")
    assert default_report_path([dense, other]).name == "compare-runs_tiny_cpu-dense-1-vs-elsewhere_tiny_cpu-dense-1.png"
    many = default_report_path([dense, sparse, dense, sparse, dense], where=tmp_path)
    assert many.parent == tmp_path and many.name.endswith("-and-2-more.png")


def test_report_shows_the_last_loss_against_dense(tmp_path):
    """The table gives the last iteration's loss beside the mean of the last 10, and how far it is
    from the dense run's; a run summarised before the field existed shows ``-``."""
    dense = _fake_run(tmp_path, "tiny_cpu-dense-1", "dense")
    sparse = _fake_run(tmp_path, "tiny_cpu-spccl-1", "spccl")
    old = _fake_run(tmp_path, "tiny_cpu-spccl-old", "spccl")
    summary = json.loads((old / "summary.json").read_text())
    del summary["last_loss"]
    (old / "summary.json").write_text(json.dumps(summary))
    last = {run: json.loads((run / "summary.json").read_text()).get("last_loss") for run in (dense, sparse)}
    assert last[dense] == _losses(dense)[-1] and last[sparse] == _losses(sparse)[-1]
    lines = {line.split()[0]: line.split() for line in report_table([dense, sparse, old]).splitlines()[2:]}
    assert lines["tiny_cpu-dense-1"][7:9] == [f"{last[dense]:.3f}", "+0.0%"]
    assert lines["tiny_cpu-spccl-1"][7:9] == [f"{last[sparse]:.3f}", f"{100 * (last[sparse] / last[dense] - 1):+.1f}%"]
    assert lines["tiny_cpu-spccl-old"][7:9] == ["-", "-"]


def test_report_help_names_the_default_path(capsys):
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    assert "compare-<RUN>-vs-<RUN>.png in the current directory" in " ".join(capsys.readouterr().out.split())


def test_report_rejects_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "not a finished run folder" in capsys.readouterr().err


def test_local_rendezvous_holds_its_port_for_the_whole_launch():
    """The store listens on its port for as long as the ranks may join: no other process can take
    it between picking and binding (the race of picking a free port and closing it)."""
    with local_rendezvous(2) as env:
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["WORLD_SIZE"] == "2"
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", int(env["MASTER_PORT"])))


def test_the_cost_model_is_a_config_key(monkeypatch):
    monkeypatch.setattr(T.dist, "get_world_size", lambda group=None: 4)
    assert T.collective_config(C.load_config(None), local_world=2).cost_model == "measured"  # the default
    cfg = C.load_config(None, ["spccl.collective.cost_model=default"])
    assert T.collective_config(cfg, local_world=2).cost_model == "default"
    with pytest.raises(C.ConfigError, match="cost_model"):
        C.load_config(None, ["spccl.collective.cost_model=guessed"])


def test_capacity_factor_gives_way_to_exact_sizes_across_nodes(monkeypatch):
    monkeypatch.setattr(T.dist, "get_world_size", lambda group=None: 4)
    bounded = ["spccl.capacity_factor=4", "spccl.collective.cuda_graphs=true"]
    one_node = C.load_config(None, bounded)
    assert T.capacity_factor(one_node, local_world=4) == 4.0
    assert T.collective_config(one_node, local_world=4).cuda_graphs
    for spanning in (C.load_config(None, bounded), C.load_config(None, [*bounded, "dist.ranks_per_node=2"])):
        local_world = 2 if not spanning.dist.ranks_per_node else 4
        assert T.capacity_factor(spanning, local_world) is None
        assert not T.collective_config(spanning, local_world).cuda_graphs  # graphs replay bounded calls only
    keep = C.load_config(None, [*bounded, "spccl.exact_across_nodes=false"])
    assert T.capacity_factor(keep, local_world=2) == 4.0 and T.collective_config(keep, local_world=2).cuda_graphs
    assert T.capacity_factor(C.load_config(None), local_world=2) is None  # 0: exchanged counts everywhere
    hierarchical = C.load_config(
        None, [*bounded, "spccl.collective.algorithm=hierarchical", "spccl.exact_across_nodes=false"]
    )
    assert T.capacity_factor(hierarchical, local_world=2) is None  # its steps take no bounds


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        (["dist.emulate_nodes=3"], {}, "dist.emulate_nodes=3 does not split 2 ranks into equal nodes; pick a number"),
        (["dist.emulate_nodes=2", "dist.ranks_per_node=2"], {}, "dist.ranks_per_node=2 contradicts"),
        (["dist.emulate_nodes=2"], {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, "but this launch spans hosts"),
    ],
)
def test_emulation_errors_are_said_once_before_any_rank_starts(overrides, env, message, monkeypatch, capsys):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(T, "launch", lambda *a: pytest.fail("a rank was started"))
    assert cli.main(overrides) == 2
    assert message in capsys.readouterr().err


def test_text_files_split_into_lines_as_the_datasets_text_loader_does(tmp_path):
    from spccl_train.train.data import _load_lines

    path = tmp_path / "t.txt"
    path.write_bytes("a\u2028b\x0bc\nd\r\ne\rf\n".encode())  # only newlines split (universal newlines on read)
    assert _load_lines([path], tmp_path) == ["a\u2028b\x0bc", "d", "e", "f"]  # what datasets' loader gives
