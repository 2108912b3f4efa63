"""What the collectives keep between calls: each process group's state, and the memos.

**Per group** (:class:`GroupState`, one per process group object, held weakly: a group kept alive
here would outlive ``destroy_process_group``, and its backend's threads the interpreter):

- its :class:`~spccl_train.transport.P2PTransport` (rank and peers are fixed);
- its ranks per node as the launch describes them (:func:`~.context.group_ranks_per_node`);
- its measured cost models (:mod:`.links`, probed on its first call) and the corrections learned
  from its calls' times (:mod:`.feedback`), equal on every rank of the group;
- the call shapes an exchange has checked on every rank (``check_calls="first"``), those whose
  exchanged calls chose the native collective (:class:`NativeHolds`), and what a held call of
  each needs (its route);
- the bounds, decision and plans its exchanged calls last ran, by call shape (:mod:`.reuse`);
- the subgroups of its hierarchical collectives (:mod:`.hierarchical`).

Every rank of a group changes its state alike (the same calls, the same exchanged figures), so the
ranks' decisions stay equal without a synchronisation of their own.

**Memos** (:class:`Memo`): pure functions' results by their inputs (decisions, hierarchical step
curves, weighing terms, bounded plans, ...). Forgetting one costs only its recomputation, so
each forgets everything when full, and :func:`clear_memos` forgets them all (to time the cold path).
A group's state is not a memo: its ranks must change it alike, so nothing here forgets it on one
rank alone.

Elsewhere, for their own reasons: captured CUDA graphs and the bounds they were captured with
(:mod:`.graphs`: resources, freed by ``clear_graphs`` before a group is destroyed), and the
per-process count of probes that orders the codec calibrations of ranks sharing a device
(:mod:`.links`).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

import torch.distributed as dist

from ..transport import P2PTransport
from .feedback import Corrections
from .reuse import PlanStore

__all__ = ["GroupState", "Memo", "NativeHolds", "clear_memos", "group_state", "live_states", "state_of"]


class Memo(dict):
    """A pure memo that holds at most ``max_entries`` and then starts over."""

    def __init__(self, name: str, max_entries: int) -> None:
        super().__init__()
        self.name = name
        self.max_entries = max_entries
        _memos.append(weakref.ref(self))

    def put(self, key: Hashable, value):
        """Remember ``value`` under ``key`` (forgetting all else when full); returns ``value``."""
        if len(self) >= self.max_entries:
            self.clear()
        self[key] = value
        return value


_memos: list[weakref.ref] = []


def clear_memos(*names: str) -> None:
    """Forget every memo (or those named)."""
    for ref in _memos:
        memo = ref()
        if memo is not None and (not names or memo.name in names):
            memo.clear()


class NativeHolds:
    """``check_calls="first"``: call shapes whose exchanged calls chose the native collective run
    it for a while with no exchange at all (as a DDP bucket on NVLink, where the exchange alone
    costs half of NCCL's call), then one call is exchanged again to see whether the data changed.
    The hold doubles while the re-checks confirm it (1, 2, 4, ... calls, at most :data:`MAX_HOLD`)
    and ends at the first that does not. Every rank sees the same decisions, so every rank holds
    alike.

    Any native choice is held, near ties included: native is chosen only when no sparse candidate
    is predicted :data:`~.choice.NATIVE_MARGIN` faster, and at a near tie an exchange every call
    costs what the sparse call would save. On 2 H100s over NVLink, 1 GiB all-reduces at 90%
    (fp32, bf16) ran at 1.32-1.39x the best fixed candidate when only native choices with every
    sparse candidate 25% slower were held (an exchange and a count pass every call), and at
    1.02-1.12x holding every native choice (``bench/results/2026-11-26_tenth/``)."""

    MAX_HOLD = 16
    """Calls run native in a row at most before a re-check: a sparsity that changes (pruning that
    starts after dense warm-up steps) is seen within this many calls, and a re-check costs at most
    1/17 of the calls an exchange."""

    __slots__ = ("_holds", "_sparse")

    def __init__(self) -> None:
        self._holds: dict[Hashable, list[int]] = {}
        """``{signature: [calls left, hold]}``."""
        self._sparse: set[Hashable] = set()
        """Signatures whose last exchanged call chose anything but native (a trial included)."""

    def take(self, signature: Hashable) -> bool:
        """Whether this call of ``signature`` runs native unexchanged (one call of the hold spent)."""
        hold = self._holds.get(signature)
        if hold is None or hold[0] == 0:
            return False
        hold[0] -= 1
        return True

    def decided(self, signature: Hashable, native: bool) -> None:
        """An exchanged call of ``signature`` chose: native (not on trial) starts or doubles the
        hold; anything else ends it."""
        if not native:
            self._holds.pop(signature, None)
            if len(self._sparse) >= 1024:  # every rank forgets alike
                self._sparse.clear()
            self._sparse.add(signature)
            return
        self._sparse.discard(signature)
        if len(self._holds) >= 1024:  # every rank forgets alike
            self._holds.clear()
        previous = self._holds.get(signature)
        span = 1 if previous is None else min(2 * previous[1], self.MAX_HOLD)
        self._holds[signature] = [span, span]

    def release(self) -> None:
        """End every hold: the next call of each held shape is exchanged (``context.release_holds``)."""
        self._holds.clear()

    def went_sparse(self, signature: Hashable) -> bool:
        """Whether the last exchanged call of ``signature`` chose a sparse candidate (or ran a trial)."""
        return signature in self._sparse


class GroupState:
    """One process group's state (see the module's text)."""

    __slots__ = (
        "transport", "nodes", "measured", "corrections", "checked", "holds", "routes", "plans", "subgroups",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, transport: P2PTransport) -> None:
        self.transport = transport
        self.nodes: dict[int, int | None] = {}
        """``{launch ranks per node: the group's ranks per node}``."""
        self.measured: dict[tuple, object] = {}
        """``{(ranks_per_node, device type): links.Measured}``."""
        self.corrections = Corrections()
        self.checked: set[tuple[int, ...]] = set()
        """Signatures of the call shapes an exchange checked on every rank."""
        self.holds = NativeHolds()
        """Call shapes that run native without an exchange for now (``check_calls="first"``)."""
        self.routes: dict[tuple, object] = {}
        """What a call shape that ran native without an exchange needs for its next such call,
        by its key (``held.Route``, at most 256; made from the measured model, so forgotten with it)."""
        self.plans = PlanStore()
        """Exchanged calls' last bounds, decisions and plans, by call shape (:mod:`.reuse`)."""
        self.subgroups: dict[int, tuple] = {}
        """``{ranks_per_node: (intra, inter)}``: this rank's node and cross-node subgroups."""


_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_state(group: dist.ProcessGroup | None) -> GroupState:
    """The state of ``group`` (``None``: the default group), made on first use."""
    key = group if group is not None or not dist.is_available() else dist.group.WORLD  # None before init
    state = _groups.get(key) if key is not None else None
    if state is None:
        if not (dist.is_available() and dist.is_initialized()):
            P2PTransport(group)  # raises the not-initialised error
        state = _groups[key] = GroupState(P2PTransport(group))
    return state


def state_of(transport: P2PTransport) -> GroupState:
    """The state of ``transport``'s group (a transport made outside :func:`group_state` shares it)."""
    return group_state(transport.group)


def live_states() -> list[GroupState]:
    """The state of every group still alive."""
    return list(_groups.values())
