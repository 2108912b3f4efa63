"""CollectiveConfig, Topology and the planning exchange's checks, without processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spccl_train.collectives import DEFAULT_THRESHOLDS, CollectiveConfig, CostModel, Thresholds, Topology
from spccl_train.collectives.exchange import HEADER_FIELDS, Problem, Request, check_table, config_code
from spccl_train.formats import Format


def test_defaults():
    cfg = CollectiveConfig()
    assert (cfg.format, cfg.algorithm, cfg.ranks_per_node, cfg.channels, cfg.cost_model) == (
        "auto", "auto", None, 1, "measured",
    )  # fmt: skip
    assert cfg.thresholds.resolve("pici") == DEFAULT_THRESHOLDS[Format.PICI]
    assert cfg.thresholds.resolve("coo") == DEFAULT_THRESHOLDS[Format.COO]
    for name in ("format", "algorithm", "thresholds", "ranks_per_node", "channels", "cost_model"):
        assert any(f.name == name for f in dataclasses.fields(CollectiveConfig))
    with pytest.raises(TypeError):
        CollectiveConfig("pici")  # keyword-only
    # None keeps its meaning from before measuring existed: the fixed defaults
    assert CollectiveConfig(cost_model=None).fingerprint() == CollectiveConfig(cost_model="default").fingerprint()
    assert CollectiveConfig().fingerprint() != CollectiveConfig(cost_model="default").fingerprint()


def test_every_field_has_a_docstring():
    import ast
    import inspect

    from spccl_train.collectives import config

    tree = ast.parse(inspect.getsource(config))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("CollectiveConfig", "Thresholds")):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1]
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), node.target.id


def test_thresholds_override_one_field():
    th = Thresholds(inter=0.3)
    assert th.resolve("pici") == dataclasses.replace(DEFAULT_THRESHOLDS[Format.PICI], inter=0.3)
    assert th.resolve("coo").inter == 0.3 and th.resolve("coo").intra == 0.8
    cfg = CollectiveConfig(thresholds={"ag": 0.25})
    assert cfg.thresholds == Thresholds(ag=0.25)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"format": "pcii"}, "format='pcii' is not one of 'auto', 'pici', 'coo', 'dense'"),
        ({"algorithm": "tree"}, "algorithm='tree'"),
        ({"ranks_per_node": 0}, "ranks_per_node=0 must be a positive int"),
        ({"ranks_per_node": True}, "ranks_per_node=True"),
        ({"channels": 0}, "channels=0 must be an int from 1 to 64"),
        ({"channels": 65}, "channels=65"),
        ({"channels": 2.0}, "channels=2.0"),
        ({"thresholds": {"intra": 0.5, "outer": 0.1}}, r"unknown keys \['outer'\]"),
        ({"thresholds": (0.1, 0.2, 0.3)}, "must be a Thresholds"),
        ({"cost_model": "fast"}, "cost_model='fast' must be a CostModel or one of 'measured', 'default'"),
        ({"cuda_graphs": 1}, "cuda_graphs=1 must be True or False"),
    ],
)
def test_bad_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CollectiveConfig(**kwargs)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.5", True])
def test_bad_threshold(value):
    with pytest.raises(ValueError, match=r"thresholds\.intra=.* is not a sparsity in \[0, 1\]"):
        Thresholds(intra=value)


def test_validate_catches_later_mutation():
    cfg = CollectiveConfig()
    cfg.channels = 0
    with pytest.raises(ValueError, match="channels=0"):
        cfg.validate()


def test_fingerprint():
    a = CollectiveConfig(format="pici", thresholds=Thresholds(intra=0.5))
    assert a.fingerprint() == CollectiveConfig(format="pici", thresholds=Thresholds(intra=0.5)).fingerprint()
    others = [
        CollectiveConfig(format="coo", thresholds=Thresholds(intra=0.5)),
        CollectiveConfig(format="pici", thresholds=Thresholds(intra=0.5000001)),
        CollectiveConfig(format="pici", thresholds=Thresholds(intra=0.5), channels=2),
        CollectiveConfig(format="pici", thresholds=Thresholds(intra=0.5), ranks_per_node=4),
        CollectiveConfig(format="pici", thresholds=Thresholds(intra=0.5), cost_model=CostModel.default("cpu")),
    ]
    assert len({c.fingerprint() for c in others} | {a.fingerprint()}) == 6
    assert config_code(a.fingerprint()) == config_code(a.fingerprint())
    # capturing is collective and auto prices replayed calls apart: ranks must agree on it too
    graphed = CollectiveConfig(format="pici", thresholds=Thresholds(intra=0.5), cuda_graphs=True)
    assert graphed.fingerprint() != a.fingerprint()


def test_topology():
    t = Topology(5, ranks_per_node=2)
    assert [t.node_of(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert t.nodes == 3 and t.ring_crosses_nodes
    assert t.is_inter(1, 2) and not t.is_inter(2, 3) and t.is_inter(4, 0)
    single = Topology(4)
    assert single.nodes == 1 and not single.ring_crosses_nodes and not single.is_inter(0, 3)
    assert not Topology(4, ranks_per_node=8).ring_crosses_nodes
    with pytest.raises(ValueError, match="rank 5 is outside"):
        t.node_of(5)
    with pytest.raises(ValueError, match="ranks_per_node=0"):
        Topology(2, 0)


# ----------------------------------------------------------------------------- the exchange's checks


def _row(
    collective="all_reduce",
    numel=100,
    out_numel=None,
    dtype=torch.float32,
    out_dtype=None,
    problems=0,
    config=7,
    channels=1,
    device="cpu",
):
    request = Request(
        collective=collective,
        numel=numel,
        out_numel=numel if out_numel is None else out_numel,
        dtype=dtype,
        out_dtype=dtype if out_dtype is None else out_dtype,
        device=torch.device(device),
        config=config,
        problems=Problem(problems),
        channels=channels,
    )
    header = request.header()
    assert len(header) == len(HEADER_FIELDS)
    return header + [0, 0]


def _raises(table, collective="all_reduce", world=None):
    with pytest.raises(ValueError) as info:
        check_table(table, collective, world or len(table), "gloo")
    return str(info.value)


def test_good_table_passes():
    check_table([_row(), _row(), _row()], "all_reduce", 3)


def test_numel_and_dtype_mismatch():
    text = _raises([_row(numel=100), _row(numel=101)])
    assert "ranks disagree on the input numel (rank 0: 100, rank 1: 101)" in text
    assert text.startswith("spccl_train.all_reduce:")
    text = _raises([_row(), _row(dtype=torch.bfloat16)])
    assert "disagree on the dtype (rank 0: torch.float32, rank 1: torch.bfloat16)" in text


def test_local_problems_are_reported_for_every_rank():
    table = [
        _row("all_gather", 4, 12),
        _row("all_gather", 4, 10, problems=Problem.OUTPUT_SIZE),
        _row("all_gather", 4, 12, problems=Problem.INPUT_NOT_CONTIGUOUS | Problem.UNSUPPORTED_DTYPE, dtype=torch.int32),
    ]
    text = _raises(table, "all_gather")
    assert text.startswith("spccl_train.all_gather_into_tensor: invalid arguments on 2 of 3 ranks.")
    assert "rank 1: the output has 10 elements but needs world_size * input.numel() = 3 * 4 = 12" in text
    assert "rank 2: the input is not contiguous; pass input.contiguous()" in text
    assert "dtype torch.int32 is not supported" in text


@pytest.mark.parametrize(
    "flag, words",
    [
        (Problem.OUTPUT_NOT_CONTIGUOUS, "output is not contiguous"),
        (Problem.DTYPES_DIFFER, "output dtype"),
        (Problem.DEVICE, "backend (gloo) does not move"),
        (Problem.DEVICES_DIFFER, "different devices"),
        (Problem.TOO_LARGE, "raise channels"),
        (Problem.OVERLAP, "overlaps the input"),
    ],
)
def test_each_problem_has_words(flag, words):
    assert words in _raises(
        [_row("reduce_scatter", 8, 4, problems=flag), _row("reduce_scatter", 8, 4)], "reduce_scatter"
    )


def test_reduce_scatter_size_message():
    text = _raises([_row("reduce_scatter", 9, 4, problems=Problem.OUTPUT_SIZE)], "reduce_scatter", 2)
    assert "the input has 9 elements but needs world_size * output.numel() = 2 * 4 = 8" in text


def test_mixed_collectives_and_configs():
    text = _raises([_row("all_reduce"), _row("all_gather")])
    assert text.startswith("spccl_train: ranks called different collectives (rank 0: all_reduce, rank 1: all_gather")
    text = _raises([_row(config=1), _row(config=2), _row(config=1)])
    assert "different CollectiveConfigs (alike within: ranks [0, 2]; ranks [1])" in text
    assert "different CollectiveConfigs" in _raises([_row(channels=1), _row(channels=2)])


def test_stray_rows():
    row = _row()
    row[0] = 12345
    assert "ranks [1] are not in a spccl_train collective" in _raises([_row(), row])
