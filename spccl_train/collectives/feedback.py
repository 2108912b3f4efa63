"""The measured cost model, corrected by what calls took: the same correction on every rank.

The probe (:mod:`.links`) measures short transfers; a long collective can see less bandwidth
(shared loopback sockets, a congested network) or more, and the model then mispredicts it by a
steady factor. Each call's prediction is therefore checked against its measured time, and a
call that is far from its prediction (:data:`FAR`) moves the factor of its kind toward
measured / predicted. Later weighings multiply that kind's predictions by the factor.

One far call is not yet a steady error: a network hiccup makes one call slow. The ratio a kind
learns from is the median of its call's, its previous call's and its factor, so a lone outlier
moves nothing and two far calls in a row do. The first observation after the warm-up has no
previous one and is learned from alone (the warm-up's own time, slow with setup, is no guide).
On one H100 as 2 emulated nodes (2026-11-26), one slow direct/COO call of 256 MiB at 99.9%
(learned from alone, halfway) moved ``auto`` to direct/Pici for good, at 1.32x the fixed
direct/COO call's time.

Decisions must be equal on every rank without a synchronisation of their own, and one rank does
not know the others' times. So observations travel in the next planning exchange: each rank puts
the measured time of its previous call on the group into its row's header (nanoseconds, ``-1``
when it has none or it has not finished on the device: nothing waits for it). Every rank reads
the same row of times, takes the slowest (a collective ends with its slowest rank) and, only when
every rank reported, applies the same arithmetic to the same numbers. Ranks made the same
decision for the previous call, so they hold the same kind and prediction for it.

A kind is ``(collective, candidate, size class, element type)``: the candidate as
``"ring/pici"`` or ``"native/dense"``, the size class the call's bytes to the nearest power of 4,
since the model's error grows with the transfer length, and the element type, since the codecs'
speed per byte is not the same (bf16 Pici compress runs at 0.52 of copy, fp32 at 0.72) and the
model is calibrated on fp32 alone: a bf16 call of 256 MiB learning from fp32 ones of 256 MiB
(4 GPUs as 4 emulated nodes, 2026-11-26) predicted direct/Pici at 150 ms where it ran 45 and
left it for a ring that ran 64. The first observation of a kind is left out
(connection setup, allocation and compilation make it slow), as benchmarks leave out warm-up.

A near-tied candidate that ``auto`` never runs is never observed, so a misprice that makes it look
slower than it is stays (4 ranks as 4 emulated nodes on one H100, 256 MiB at 99%, 2026-11-26:
direct/COO priced at 1.22x its 58.5 ms, a hair above direct/Pici, which ran 68.4 ms, in four
sittings out of four). So every call counts as a *run* of its kind at its density octave
(:attr:`~.summary.CountSummary.octave`), and :meth:`Corrections.tried` names the candidates run
:data:`TRIAL_RUNS` times at the call's octave: a candidate (the native call too) predicted within
:data:`~.choice.TRIAL_MARGIN` of the choice and not yet tried there is run instead, twice (a
*trial*: its first observation can be a kind's warm-up), and then weighed on what it was seen to
take. Trials are bounded: at most two calls per candidate, density octave, size class and element
type, counted when they run, whether observed or not (a DDP hook's overlapped calls are seldom
observed), and one more where the kind's warm-up fell among them: that run teaches nothing, and a
trial judged on one observation was judged on its noise (4 ranks as 4 emulated nodes on one H100,
256 MiB at 99%, 2026-11-26: direct/COO tried in a kind's warm-up and one call, then left for
direct/Pici, which took 1.21x direct/COO's time). A trial does not become the group's preference
(``last``), so it is not kept by :data:`~.choice.STICKY_MARGIN` unless it measured better.

What a candidate was seen to take at the call's octave is used as it is: the kind's factor is fitted
across densities and moves only beyond :data:`FAR`, so inside that band two candidates whose errors
differ stay misordered (in the sweep above after a trial of direct/COO: priced 79.3 ms against
direct/Pici's 82.0, inside the sticky margin, while they ran 73.8 and 82.7). So the last
:data:`LOCAL_CALLS` observed ratios of each kind at each octave are kept, and at that octave the
candidate's factor is the least of them (to 1/16 of an octave, so that repeated calls share a
memoised decision), in place of the kind's. The least, not the median: a call's time is the slowest
rank's, so noise only adds to it (a socket stall, a rank that entered late), and a candidate leaves
only after :data:`LOCAL_CALLS` slow calls in a row. The candidate ``auto`` runs is observed call
after call, so its figure follows the links within :data:`LOCAL_CALLS` calls; one it left keeps
the figure it left with, so a figure raised by noise would be a candidate lost for good: with the
median, two stalled direct/Pici calls of 256 MiB at 90% (2 ranks as 2 emulated nodes on one H100,
2026-11-27) raised its figure past direct/COO's, and ``auto`` ran direct/COO from then on at 1.62x
direct/Pici's time; with the least, on 2 H100s over NVLink (1 GiB fp32 at 99.9%, 2026-11-27),
``auto`` left direct/Pici in its settling calls and ran direct/COO at 1.16x direct/Pici's time
through all 15 timed calls. So a tried candidate counts as tried at an octave only while it ran
there within the last :data:`REFRESH_CALLS` calls of its collective, size class and element type at
that octave: one left longer is run again once (a trial, if still within
:data:`~.choice.TRIAL_MARGIN` of the choice), and that call's figure, the least of its last ones,
takes it back if it is faster now. It costs at most one call in :data:`REFRESH_CALLS` per near
candidate, as a native hold's re-check does.

A sparse kind not yet observed takes a share of what the observed sparse kinds of its collective
and size class learned (:data:`UNOBSERVED`): much of the model's error is shared by the
candidates of one call (the same links carry them), and weighing an unobserved candidate
uncorrected made ``auto`` hop from a corrected good choice to each optimistic unobserved one in
turn (2 ranks on one H100 as 2 emulated nodes, 1 GiB at 90%: four candidates tried, 1.7x the
best fixed one's time). Part, not all: one kind's error is also its own (a candidate that alone
is slow must still be left). With log factor = shared + own, both parts equally spread, the
expected shared part after ``n`` observed kinds is ``n / (n + 1)`` of their mean log factor, and
that is what an unobserved kind takes, and what it starts learning from once observed. The native
call and the hierarchical one keep factors of their own (:data:`OWN_ONLY`): NCCL's dense
transfers are not SpCCL's, and the hierarchical call's steps mix both.

What it costs: one more int in the exchange's header; learning is O(world) host work per call,
and a call's factors walk only the kinds of its collective, size class and element type (on the
development CPU, with 100 kinds seen, ``factors_for`` 25.8 -> 7.1 us and ``least_local`` 30.1 ->
10.1 us against a walk over every kind; 30 kinds: 9.2 -> 6.7 and 12.6 -> 10.4).
What it misses: a call whose work is still running at the next exchange (back-to-back calls on
CUDA, as a DDP hook issues its buckets) reports ``-1``, so with overlapped calls a kind learns
from the calls that finished before the next one was planned (in training: the last bucket of
each step). Calls planned from bounds (no exchange) are observed and reported at the next
exchange. Only the measured model is corrected: a :class:`~.cost.CostModel` given in the
config is the caller's and is used as given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from .._timing import Span

__all__ = [
    "FACTOR_RANGE",
    "FAR",
    "LOCAL_CALLS",
    "NATIVE",
    "OWN_ONLY",
    "REFRESH_CALLS",
    "STEP",
    "TRIAL_RUNS",
    "UNOBSERVED",
    "Corrections",
    "factor_of",
    "kind_of",
    "size_class",
]

FAR = 1.15
"""A measured time more than this factor away from its prediction (either way) corrects the model.
It was 1.25 before the median (lone outliers no longer move a factor): a misprice of 1.22x stayed
(the module docstring's trial)."""
STEP = 0.5
"""How far one observation moves a factor toward what it saw, in log space (1: all the way).
Halfway reaches a steady error of 4x within 4 observations to within :data:`FAR`."""
FACTOR_RANGE = (1 / 16, 16.0)
"""Bounds of a factor: the model is fitted, not guessed, and stays within this of its figures."""
NATIVE = "native/dense"
"""The native call's candidate name."""
OWN_ONLY = frozenset({NATIVE, "hierarchical"})
"""Candidates that neither give nor take the share of :data:`UNOBSERVED`."""
LOCAL_CALLS = 3
"""Observations of a kind at one density octave whose least is its factor there."""
TRIAL_RUNS = 2
"""Runs of a candidate at a call's density octave after which it counts as tried there
(:meth:`Corrections.tried`)."""
REFRESH_CALLS = 16
"""Calls at a density octave (of one collective, size class and element type) after which a
candidate not run among them counts as untried there again (:meth:`Corrections.tried`)."""
UNOBSERVED = "*"
"""Key, in :meth:`Corrections.factors_for`, of the factor of sparse candidates with no
observation of their own."""


def factor_of(factors: Mapping[str, float] | None, candidate: str) -> float:
    """The factor a candidate's prediction is multiplied by: its own, else (sparse candidates)
    the factor of the unobserved, else 1."""
    if not factors:
        return 1.0
    if candidate in factors:
        return factors[candidate]
    return 1.0 if candidate in OWN_ONLY else factors.get(UNOBSERVED, 1.0)


def _local_factor(ratios: list[float]) -> float:
    """The least of a kind's last observations at an octave, to 1/16 of an octave: calls whose
    least observations round alike weigh alike, and share a memoised decision."""
    return 2.0 ** (round(16 * math.log2(min(ratios))) / 16)


def _type_name(dtype: torch.dtype | None) -> str:
    return "" if dtype is None else str(dtype).removeprefix("torch.")


def size_class(nbytes: int) -> int:
    """The call's bytes to the nearest power of 4 (as the exponent): 64 MiB, 256 MiB and 1 GiB
    are classes 13, 14 and 15."""
    return round(math.log(max(nbytes, 1), 4))


def kind_of(
    collective: str, candidate: str, nbytes: int, dtype: torch.dtype | None = None
) -> tuple[str, str, int, str]:
    """The kind of call a factor belongs to: collective, candidate, :func:`size_class`, element type."""
    return (collective, candidate, size_class(nbytes), _type_name(dtype))


@dataclasses.dataclass(slots=True)
class _Runs:
    """The calls at one density octave of one collective, size class and element type, for
    :meth:`Corrections.tried`."""

    calls: int = 0
    """Calls so far (those that weighed their candidates)."""
    count: dict[str, int] = dataclasses.field(default_factory=dict)
    """By candidate, its runs (a kind's warm-up left out)."""
    last: dict[str, int] = dataclasses.field(default_factory=dict)
    """By candidate, :attr:`calls` at its last run."""


@dataclasses.dataclass(slots=True)
class _Pending:
    kind: tuple[str, str, int, str]
    predicted_s: float
    """The uncorrected prediction (equal on every rank)."""
    timer: Span
    octave: int | None


class Corrections:
    """One group's correction factors, and this rank's last call on the group, not yet reported.

    Every rank of the group holds an equal copy: its factors change only in :meth:`learn`, from
    the exchanged row of times, and its runs and last candidates in :meth:`ran`, which every rank
    calls alike. ``version`` counts the changes of a factor (for logs and tests);
    ``revision`` moves with every counted observation, so with every change of what
    :meth:`factors_for` returns, for results kept until it moves (``held.Route``); decisions
    are memoised under the factors themselves and the tried candidates (:func:`~.choice.decide`),
    so a corrected model is weighed afresh.
    """

    __slots__ = (
        "factors",
        "last",
        "seen",
        "recent",
        "local",
        "runs",
        "version",
        "revision",
        "_pending",
        "_members",
        "_octaves",
    )

    def __init__(self) -> None:
        self.factors: dict[tuple[str, str, int, str], float] = {}
        """Factor by kind (absent: 1)."""
        self.seen: dict[tuple[str, str, int, str], int] = {}
        """Observations by kind, the first (left out) included."""
        self.recent: dict[tuple[str, str, int, str], float] = {}
        """The last observed measured / predicted (uncorrected) by kind, the first left out."""
        self.local: dict[tuple[str, int, str, int], dict[str, list[float]]] = {}
        """The last :data:`LOCAL_CALLS` observed measured / predicted (uncorrected), by ``(collective,
        size class, element type, density octave)`` and candidate, the kind's first left out."""
        self.runs: dict[tuple[str, int, str, int], _Runs] = {}
        """The calls run, by ``(collective, size class, element type, density octave)`` (calls whose
        octave was given: those that weighed their candidates)."""
        self.last: dict[tuple[str, int, str, str], str] = {}
        """The candidate the group ran last, by ``(collective, size class, element type, scope)``
        (for ``choice.weigh``'s ``prefer``); the scope names the config that chose it, so that a
        call of a fixed format and algorithm does not become the preference of ``auto``'s calls."""
        self.version = 0
        self.revision = 0
        self._pending: _Pending | None = None
        self._members: dict[tuple[str, int, str], dict[tuple[str, str, int, str], None]] = {}
        """The kinds observed, by ``(collective, size class, element type)``, in the order first
        observed: a call's weighing walks its own group's, not every kind the group has seen."""
        self._octaves: dict[tuple[str, int, str], dict[int, None]] = {}
        """The density octaves of :attr:`local`, by ``(collective, size class, element type)``."""

    def factors_for(
        self, collective: str, nbytes: int, dtype: torch.dtype | None = None, octave: int | None = None
    ) -> dict[str, float]:
        """The factors of the candidates of one call of ``dtype`` elements, by candidate name, for
        :func:`factor_of`: each observed kind's own (1 where its predictions held), and under
        :data:`UNOBSERVED` the geometric mean of the ``n`` observed sparse kinds' to the power
        ``n / (n + 1)`` (absent when none was observed). At a density ``octave``, a kind observed
        there takes the least of its last observations there instead of its own."""
        size, of = size_class(nbytes), _type_name(dtype)
        own = {
            kind[1]: self.factors.get(kind, 1.0)
            for kind in self._members.get((collective, size, of), ())
            if self.seen.get(kind, 0) > 1
        }
        for name in OWN_ONLY:  # looked up as :meth:`own_factor` does
            kind = (collective, name, size, of)
            if self.seen.get(kind, 0) > 1:
                own[name] = self.factors.get(kind, 1.0)
        share = self._shared((collective, "", size, of))
        if share is not None:
            own[UNOBSERVED] = share
        if octave is not None:
            for name, ratios in self.local.get((collective, size, of, octave), {}).items():
                own[name] = _local_factor(ratios)
        return own

    def least_local(self, collective: str, nbytes: int, dtype: torch.dtype | None = None) -> float | None:
        """The smallest factor any sparse candidate takes at any density octave for calls of this
        collective, size class and element type (``None``: none observed): what a bound over every
        density must allow (``held.held_now``)."""
        size, of = size_class(nbytes), _type_name(dtype)
        found = [
            _local_factor(ratios)
            for octave in self._octaves.get((collective, size, of), ())
            for name, ratios in self.local[(collective, size, of, octave)].items()
            if name not in OWN_ONLY
        ]
        return min(found) if found else None

    def own_factor(self, kind: tuple[str, str, int, str]) -> float:
        """:func:`factor_of` of :meth:`factors_for` for a :func:`kind_of` whose candidate is of
        :data:`OWN_ONLY` (the native call), without making the whole dict."""
        assert kind[1] in OWN_ONLY, kind
        return self.factors.get(kind, 1.0) if self.seen.get(kind, 0) > 1 else 1.0

    def called(
        self,
        collective: str,
        candidate: str,
        nbytes: int,
        predicted_s: float,
        timer: Span,
        dtype: torch.dtype | None = None,
        scope: str = "",
        octave: int | None = None,
        trial: bool = False,
    ) -> None:
        """Remember this rank's call (its uncorrected prediction and its timer) for the next exchange,
        and that the group ran ``candidate`` under the config ``scope`` names, unless it was a
        ``trial``; ``octave``: the call's :attr:`~.summary.CountSummary.octave`, counting the run for
        :meth:`tried` (every rank of the group calls this alike)."""
        self.ran(kind_of(collective, candidate, nbytes, dtype), predicted_s, timer, scope, octave, trial)

    def ran(
        self,
        kind: tuple[str, str, int, str],
        predicted_s: float,
        timer: Span,
        scope: str = "",
        octave: int | None = None,
        trial: bool = False,
    ) -> None:
        """:meth:`called`, for a call of a :func:`kind_of` made beforehand."""
        collective, candidate, size, of = kind
        self._pending = _Pending(kind, predicted_s, timer, octave)
        if octave is not None:
            here = self.runs.setdefault((collective, size, of, octave), _Runs())
            here.calls += 1
            here.count[candidate] = here.count.get(candidate, 0) + 1
            here.last[candidate] = here.calls
        if not trial:
            self.last[(collective, size, of, scope)] = candidate

    def tried(self, collective: str, nbytes: int, dtype: torch.dtype | None, octave: int) -> frozenset[str]:
        """The candidates run :data:`TRIAL_RUNS` times or more for calls of this collective, size
        class and element type at density ``octave``, their kind's warm-up not counted, and run
        among the last :data:`REFRESH_CALLS` calls there."""
        here = self.runs.get((collective, size_class(nbytes), _type_name(dtype), octave))
        if here is None:
            return frozenset()
        return frozenset(
            name for name, n in here.count.items() if n >= TRIAL_RUNS and here.calls - here.last[name] < REFRESH_CALLS
        )

    def ran_at(self, collective: str, nbytes: int, dtype: torch.dtype | None, octave: int) -> frozenset[str]:
        """The candidates ever run :data:`TRIAL_RUNS` times or more for calls of this collective,
        size class and element type at density ``octave`` (:meth:`tried` without its refresh)."""
        here = self.runs.get((collective, size_class(nbytes), _type_name(dtype), octave))
        if here is None:
            return frozenset()
        return frozenset(name for name, n in here.count.items() if n >= TRIAL_RUNS)

    def last_run(self, collective: str, nbytes: int, dtype: torch.dtype | None = None, scope: str = "") -> str | None:
        """The candidate the group ran last for a call of this collective, size class, element type
        and config ``scope``."""
        return self.last.get((collective, size_class(nbytes), _type_name(dtype), scope))

    def report(self) -> int:
        """This rank's entry for the next exchange: its last call's nanoseconds, ``-1`` if none or
        not finished. Never waits."""
        pending = self._pending
        try:
            if pending is None or not pending.timer.done():
                return -1
            return max(0, round(pending.timer.seconds() * 1e9))
        except RuntimeError:
            # An unreadable timer (a CUDA event that a graph or another context owns) is no
            # observation. Raising here instead would leave this rank out of an exchange that
            # the others wait in; -1 makes every rank skip this call alike.
            return -1

    def learn(self, times_ns: Sequence[int]) -> bool:
        """Fold the exchanged times of the last call (every rank's :meth:`report`) into its kind's
        factor; returns whether the model changed. Equal inputs on every rank, equal results."""
        pending, self._pending = self._pending, None
        if pending is None or not times_ns or min(times_ns) < 0 or pending.predicted_s <= 0:
            return False
        kind = pending.kind
        self.seen[kind] = self.seen.get(kind, 0) + 1
        self.revision += 1
        if self.seen[kind] == 1:  # warm-up; learning will start from the share it is weighed with now
            self._members.setdefault((kind[0], kind[2], kind[3]), {})[kind] = None
            if pending.octave is not None:  # a run that taught nothing does not count as a trial's
                collective, candidate, size, of = kind
                self.runs[(collective, size, of, pending.octave)].count[candidate] -= 1
            share = self._shared(kind)
            if share is not None and kind[1] not in OWN_ONLY:
                self.factors[kind] = share
            return False
        ratio = max(times_ns) / 1e9 / pending.predicted_s
        if pending.octave is not None:
            collective, candidate, size, of = kind
            self._octaves.setdefault((collective, size, of), {})[pending.octave] = None
            ratios = self.local.setdefault((collective, size, of, pending.octave), {}).setdefault(candidate, [])
            ratios.append(min(max(ratio, FACTOR_RANGE[0]), FACTOR_RANGE[1]))
            del ratios[:-LOCAL_CALLS]
        previous, self.recent[kind] = self.recent.get(kind), ratio
        old = self.factors.get(kind, 1.0)
        heard = ratio if previous is None else sorted((previous, ratio, old))[1]  # a lone outlier: old
        if 1 / FAR <= heard / old <= FAR:
            return False
        target = math.log(heard)
        lo, hi = FACTOR_RANGE
        new = min(hi, max(lo, math.exp(math.log(old) + STEP * (target - math.log(old)))))
        if new == old:
            return False
        self.factors[kind] = new
        self.version += 1
        return True

    def _shared(self, kind: tuple[str, str, int, str]) -> float | None:
        """The :data:`UNOBSERVED` share of ``kind``'s collective, size class and element type."""
        collective, _, size, of = kind
        sparse = [
            math.log(self.factors.get(k, 1.0))
            for k in self._members.get((collective, size, of), ())
            if self.seen.get(k, 0) > 1 and k[1] not in OWN_ONLY
        ]
        return math.exp(sum(sparse) / (len(sparse) + 1)) if sparse else None

    def describe(self) -> str:
        """One line: every factor, by kind."""
        if not self.factors:
            return "no corrections"
        return ", ".join(
            " ".join(w for w in (collective, name, of, f"~4^{size}:") if w) + f" x{f:.2f}"
            for (collective, name, size, of), f in sorted(self.factors.items())
        )
