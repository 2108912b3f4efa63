"""What the collectives keep between calls (``collectives/state.py``): bounded pure memos, and one
state per process group, held only while the group lives."""

from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

from spccl_train.collectives import choice, hierarchical, state


def test_a_memo_forgets_everything_when_full_and_clear_memos_reaches_every_memo():
    memo = state.Memo("test memo", 3)
    for k in range(3):
        assert memo.put(k, k * k) == k * k
    assert dict(memo) == {0: 0, 1: 1, 2: 4}
    memo.put(3, 9)  # full: starts over
    assert dict(memo) == {3: 9}
    other = state.Memo("other test memo", 8)
    other.put("a", 1)
    state.clear_memos("test memo")  # by name
    assert not memo and other == {"a": 1}
    state.clear_memos()  # all of them, the library's too
    assert not other and not choice._decisions and not hierarchical._curves


def _job_state(rank, world, seed):
    g = dist.new_group()
    s = state.group_state(g)
    same = state.group_state(g) is s and state.state_of(s.transport) is s
    default = state.group_state(None) is state.group_state(dist.group.WORLD)
    distinct = state.group_state(None) is not s
    fields = (s.transport.world, s.nodes, s.measured, s.checked, s.subgroups, s.corrections.version)
    dist.destroy_process_group(g)
    del g
    gc.collect()
    alive = [x for x in state.live_states() if x is s]
    return same, default, distinct, fields, len(alive)


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    from _pool import pool_factory

    yield from pool_factory(tmp_path_factory, "state")


def test_one_state_per_group_made_once_and_dropped_with_the_group(pools):
    got = pools(2).run(_job_state, 0)
    for same, default, distinct, fields, alive in got:
        assert same and default and distinct
        assert fields == (2, {}, {}, set(), {}, 0)
        # weakly keyed by its group: once the group is destroyed and dropped, its state is no
        # longer held (the job's own reference to it aside)
        assert alive == 0
