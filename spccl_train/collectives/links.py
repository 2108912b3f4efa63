"""The cost model, measured: link terms per hop kind from a short timed probe of the group, the
planning exchange's latency as the call makes it, and codec throughputs calibrated once per device.

``auto`` is only as good as its model, and configured constants cannot know whether a hop is
NVLink at 350 GB/s or a socket at 1.8 GB/s (issue: on one GPU with emulated nodes ``auto`` kept
choosing dense and lost a 4x). So the first call of a group with ``cost_model="measured"`` (the
default) measures, collectively, on every rank of the group:

- **links**: every rank sends to its right neighbour and receives from its left one at once, on
  the ring inside its node (intra) and on the ring across nodes among ranks with the same local
  rank (inter), each at a small size (latency) and at a size that takes a few milliseconds and
  four times the small one's time (bandwidth, grown by 4x from 1 MiB until it does, or takes a
  quarter of a second). ``bandwidth = n / (t_big - t_small)``:
  bytes one rank pushes one way while all ranks push, which is how the collectives load the links;
- **the native all-reduce**: the backend's own collective on the whole group, timed as the
  links are (tiny, then grown until it takes about 10 ms), since NCCL's choice of algorithm,
  protocol and channels is its own and over sockets reaches far less than point-to-point
  transfers (:class:`~.cost.NativeCost`);
- **exchange**: a gather of one small row from every rank read back on the host, as the count
  exchange of every call without bounds is;
- **codecs**: Pici and COO encode / decode / accumulate on random 99% sparse fp32 data, timed on
  this device once and cached on disk (``$SPCCL_CACHE_DIR``, default ``~/.cache/spccl_train``)
  under the device's name and the library's version. Ranks that share a device calibrate in turn
  (at once they would time-slice it and measure each other), and the model divides the device's
  throughput among them, since during a collective their codecs do run at the same time.

A transfer's time is the fastest of a few repeats on each rank, each after a barrier (a shared
socket or network only ever delays a transfer: the fastest repeat is the link's, the slower ones
carry someone else's traffic), then the slowest rank's (MAX over the group; throughputs its MIN),
so every rank holds the same model and decides alike; a steady slowdown that a short probe does
not see is the corrections' to learn (:mod:`.feedback`). The whole probe costs milliseconds on
NVLink, tens of milliseconds on gloo and up to a few seconds over sockets (4 ranks as 4 emulated
nodes), once per group and topology. Figures the probe cannot see (intra-node links when every
node holds one rank, inter-node ones on one node) keep :meth:`CostModel.default`'s values.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import socket
import statistics
import time
import zlib

import torch
import torch.distributed as dist

from .._version import __version__
from ..formats import Format, capacity_bytes, compress_into, decompress_into
from ..transport import P2PTransport
from .cost import CodecCost, CostModel, LinkCost, NativeCost
from .state import live_states, state_of
from .topology import Topology

__all__ = ["LinkProbe", "Measured", "probe_links", "codec_costs", "measured_model", "forget_measured"]

_log = logging.getLogger(__name__)

_SMALL = 64  # bytes: latency-bound on every link
_FIRST_LARGE = 1 << 20
_LARGEST = {"cuda": 256 << 20, "cpu": 16 << 20}
_LONG_ENOUGH_S = 2e-3  # a large send this long is bandwidth-bound enough to fit the slope
_OVER_START_UP = 4  # ... and this many times the small one's: its bytes take 3/4 of its time
_NATIVE_LONG_ENOUGH_S = 10e-3  # NCCL's socket all-reduce reaches its pace later than one send
_LONGEST_S = 0.25  # grown no further once a transfer takes this long: the probe's time stays bounded
_REPEATS = 3


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkProbe:
    """What :func:`probe_links` measured (``None``: that hop kind does not occur in the group)."""

    intra: LinkCost | None
    """Ranks of one node."""
    inter: LinkCost | None
    """Ranks of different nodes."""
    native: NativeCost | None
    """The backend's all-reduce on the group (``None`` for a group of one)."""
    exchange_s: float
    """One planning exchange: a small all-gather read back on the host."""
    probe_s: float
    """Wall time the probe took on this rank."""

    def describe(self) -> str:
        """One line for logs: each measured link as bandwidth and latency."""
        parts = []
        for name, link in (("intra-node", self.intra), ("inter-node", self.inter)):
            if link is not None:
                grouped = link.collective_bandwidth
                through = f" ({grouped / 1e9:.2f} GB/s all-to-all)" if grouped is not None else ""
                parts.append(f"{name} {link.bandwidth / 1e9:.2f} GB/s{through}, {link.latency_s * 1e6:.0f} us")
        if self.native is not None:
            parts.append(f"native all-reduce {self.native.bandwidth / 1e9:.2f} GB/s per rank")
        parts.append(f"exchange {self.exchange_s * 1e3:.2f} ms (probe took {self.probe_s * 1e3:.0f} ms)")
        return "; ".join(parts)


def probe_links(transport: P2PTransport, topology: Topology, device: torch.device) -> LinkProbe:
    """Measure the group's links per hop kind and its exchange latency (collective: every rank calls it).

    ``device`` is where the buffers live (the backend must move tensors there). Every rank returns
    the same figures.
    """
    started = time.perf_counter()
    p, r = transport.world, transport.rank
    rpn = topology.ranks_per_node or p
    node, local = divmod(r, rpn) if rpn < p else (0, r)
    rings = {}
    if min(rpn, p) > 1:  # the ring inside this node
        base = node * rpn
        size = min(rpn, p - base)
        rings["intra"] = (base + (local + 1) % size, base + (local - 1) % size)
    if rpn < p:  # the ring across nodes, among ranks of the same local rank
        rings["inter"] = ((r + rpn) % p, (r - rpn) % p)
    measured: dict[str, LinkCost | None] = {"intra": None, "inter": None}
    grouped = _fit_all_to_all(transport, device) if p > 1 else None
    for kind in ("intra", "inter"):
        # Every rank must run the same probes in the same order: decide from the topology, which
        # all ranks share, not from this rank's own ring (a node of one rank has no intra ring).
        if kind == "intra" and not min(rpn, p) > 1 or kind == "inter" and not rpn < p:
            continue
        right, left = rings[kind]
        link = _fit_link(transport, device, right, left)
        # The group's all-to-all crosses its slowest hops: it prices the collectives on inter-node
        # links where there are any, and on intra-node links on one node.
        if grouped is not None and (kind == "inter" or rpn >= p):
            link = dataclasses.replace(link, collective_bandwidth=grouped)
        measured[kind] = link
    native = _fit_native(transport, topology, device) if p > 1 else None
    row = torch.zeros(8, dtype=torch.int64, device=transport.exchange_device(device))

    def exchange() -> None:
        transport.all_gather_rows(row).tolist()  # the .tolist() is the host synchronisation

    exchange_s = _slowest(transport, device, statistics.median(_times(transport, device, exchange, 5)))
    return LinkProbe(
        intra=measured["intra"],
        inter=measured["inter"],
        native=native,
        exchange_s=exchange_s,
        probe_s=time.perf_counter() - started,
    )


def _fit_link(transport: P2PTransport, device: torch.device, right: int, left: int) -> LinkCost:
    """Alpha-beta terms of sending to ``right`` while receiving from ``left`` (all ranks at once)."""

    def send(nbytes: int):
        out = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        into = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def step() -> None:
            if right != transport.rank:
                for work in transport.send_recv([(right, out)], [(left, into)]):
                    work.wait()

        return step

    latency, bandwidth = _fit(transport, device, send, pushed=lambda n: n)
    return LinkCost(latency_s=latency, bandwidth=bandwidth)


def _fit_all_to_all(transport: P2PTransport, device: torch.device) -> float:
    """Bandwidth one rank pushes through an all-to-all of the whole group (the direct algorithm's route)."""
    p = transport.world

    def exchange(nbytes: int):
        share = max(1, nbytes // p)
        out = torch.empty(share * p, dtype=torch.uint8, device=device).fill_(1)
        into = torch.empty(share * p, dtype=torch.uint8, device=device)

        def step() -> None:
            work = transport.all_to_all(into, out, [share] * p, [share] * p)
            if work is not None:
                work.wait()

        return step

    return _fit(transport, device, exchange, pushed=lambda n: max(1, n // p) * (p - 1))[1]


def _fit_native(transport: P2PTransport, topology: Topology, device: torch.device) -> NativeCost:
    """The backend's fp32 sum all-reduce on the whole group, as :class:`~.cost.NativeCost` counts it."""
    p = transport.world

    def reduce(nbytes: int):
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        return lambda: dist.all_reduce(buf, group=transport.group)

    latency, bandwidth = _fit(
        transport, device, reduce, pushed=lambda n: 2 * (p - 1) * max(4, n) / p, long_enough=_NATIVE_LONG_ENOUGH_S
    )
    return NativeCost(topology=topology, latency_s=latency, bandwidth=bandwidth)


def _fit(
    transport: P2PTransport, device: torch.device, make, pushed, long_enough: float = _LONG_ENOUGH_S
) -> tuple[float, float]:
    """``(latency_s, bytes per second)`` of the step ``make(nbytes)`` builds, fitted from a small
    size and one grown by 4x from 1 MiB until it takes ``long_enough`` and :data:`_OVER_START_UP`
    times the small one's time (or a quarter of a second, or reaches the largest size the device
    type allows); ``pushed(nbytes)``: the bytes one rank puts on the wire in it. Each size's time is
    this rank's fastest repeat; every rank gets the slowest rank's figures."""

    def seconds(nbytes: int) -> float:
        step = make(nbytes)
        return _slowest(transport, device, min(_times(transport, device, step, _REPEATS)))

    small = seconds(_SMALL)
    nbytes, large = _FIRST_LARGE, seconds(_FIRST_LARGE)
    largest = _LARGEST.get(device.type, _LARGEST["cpu"])
    # Grown until long enough, and until the bytes take most of the time: over sockets a tiny
    # call takes 3-70 ms and jitters by milliseconds, so a slope fitted on a transfer of that
    # length is the jitter's (4 ranks as 4 emulated nodes on one H200, 2026-11-26: the native
    # all-reduce fitted 4.87 and 0.06 GB/s per rank on two machines, 1.25 and 0.62 run; 2 ranks
    # as 2 nodes on one H100, the sends across nodes fitted 0.25 GB/s where other machines
    # measured 1.2-1.4, from a large size twice the start-up's 2.7 ms and medians of 3).
    while (large < long_enough or large < _OVER_START_UP * small) and large < _LONGEST_S and nbytes * 4 <= largest:
        nbytes *= 4
        large = seconds(nbytes)
    slope = large - small if large > small else large
    extra = pushed(nbytes) - pushed(_SMALL)
    return max(small, 0.0), (extra / slope if slope > 0 and extra > 0 else 1e15)


def _times(transport: P2PTransport, device: torch.device, fn, repeats: int) -> list[float]:
    """Seconds of ``fn`` on this rank, ``repeats`` times, each started together after a barrier."""
    fn()  # warm-up: connections, allocations, NCCL's lazy communicator set-up
    out = []
    for _ in range(repeats):
        _barrier(transport, device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - start)
    return out


def _barrier(transport: P2PTransport, device: torch.device) -> None:
    flag = torch.zeros(1, device=transport.exchange_device(device))
    dist.all_reduce(flag, group=transport.group)
    if flag.is_cuda:
        torch.cuda.synchronize(flag.device)


def _slowest(transport: P2PTransport, device: torch.device, seconds: float) -> float:
    """The largest of every rank's ``seconds``: the figure all ranks then share."""
    value = torch.tensor([seconds], dtype=torch.float64, device=transport.exchange_device(device))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=transport.group)
    return float(value.item())


# ----------------------------------------------------------------------------- codecs


def _cache_file(device: torch.device) -> pathlib.Path:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-reference"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    root = pathlib.Path(os.environ.get("SPCCL_CACHE_DIR", pathlib.Path.home() / ".cache" / "spccl_train"))
    return root / "codecs" / f"{safe}-{__version__}-{CALIBRATION}.json"


CALIBRATION = "slope"
"""Names how :func:`codec_costs` measures, in its cache file's name: a calibration cached by an
earlier method is measured again."""


def codec_costs(device: torch.device, *, use_cache: bool = True) -> dict[str, CodecCost]:
    """Pici and COO codec throughputs on ``device``, measured once and cached on disk.

    Measured on random 99%-sparse fp32 data, each operation at two sizes (4 Mi and 32 Mi
    elements on CUDA, 128 Ki and 1 Mi on the CPU's reference codec), each the median of five
    calls after a warm-up, timed on the host up to a device sync: the throughput is the extra
    bytes over the extra time, so that the host's cost of a call (its launch and sync, tens of
    microseconds on CUDA) is not read as bytes; ``call_s`` is one call on a single tile, that cost.
    One size, 16 Mi elements timed the same way, read 710-791 GB/s for Pici on an H100, where
    the codecs run at about 0.9 of copy speed on 1 GiB (``bench/bench_codecs.py``): the model
    priced a 1 GiB direct/Pici all-reduce at 95% over NVLink at 4.9 ms where it took 3.1, 1.6x,
    and ``auto`` never tried it (bench/results/2026-11-27_twentysecond/). On CUDA the calibration
    holds about 512 MiB while it runs (the input, the output and a COO payload's worst case), once
    per device and library version. This rank's own figures: :func:`measured_model` makes them
    equal across ranks.
    """
    path = _cache_file(device)
    if use_cache and path.is_file():
        try:
            saved = json.loads(path.read_text())
            return {fmt: CodecCost(**saved[fmt]) for fmt in ("pici", "coo")}
        except (ValueError, KeyError, TypeError):
            _log.warning("spccl_train: ignoring unreadable codec calibration %s", path)
    large = (32 << 20) if device.type == "cuda" else (1 << 20)
    sizes = (large // 8, large)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(large, device=device, generator=gen)
    x *= torch.rand(large, device=device, generator=gen) < 0.01
    into = torch.empty_like(x)
    found = {}
    for fmt in (Format.PICI, Format.COO):
        payload = torch.empty(capacity_bytes(fmt, large, x.dtype), dtype=torch.uint8, device=device)
        seconds: dict[str, list[float]] = {"compress": [], "decompress": [], "accumulate": []}  # by size
        for n in sizes:
            part, out = x[:n], into[:n]
            nnz = compress_into(fmt, part, payload) if fmt is Format.COO else None  # COO payloads do not carry it
            ops = {
                "compress": lambda: compress_into(fmt, part, payload),
                "decompress": lambda: decompress_into(fmt, payload, out, nnz=nnz, check=False),
                "accumulate": lambda: decompress_into(fmt, payload, out, nnz=nnz, accumulate=True, check=False),
            }
            for name, op in ops.items():
                seconds[name].append(_device_seconds(op, device))
        tiny, tiny_out = x[:4096], torch.empty(capacity_bytes(fmt, 4096, x.dtype), dtype=torch.uint8, device=device)
        extra_bytes = (sizes[1] - sizes[0]) * x.element_size()
        rates = {
            name: _throughput(extra_bytes, t[1] - t[0], large * x.element_size(), t[1]) for name, t in seconds.items()
        }
        found[fmt.value] = CodecCost(
            **rates, call_s=_device_seconds(lambda: compress_into(fmt, tiny, tiny_out), device)
        )
        payload = None  # freed before the next format's is made
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({k: dataclasses.asdict(v) for k, v in found.items()}, indent=1))
        except OSError as exc:  # a read-only home is no reason to fail a collective
            _log.warning("spccl_train: could not cache the codec calibration at %s: %s", path, exc)
    return found


def _throughput(extra_bytes: int, extra_s: float, whole_bytes: int, whole_s: float) -> float:
    """Bytes per second from the extra time of the larger size; where that is under 5% of the
    larger size's time (noise: a host that stalled on the smaller size), the larger size's own
    rate. A stall on the smaller size that leaves more still reads the codec faster than it is."""
    if extra_s > 0.05 * whole_s:
        return extra_bytes / extra_s
    return whole_bytes / whole_s


def _device_seconds(fn, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


# ----------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    """A group's measured cost model and what went into it."""

    model: CostModel
    tag: str
    """Names the model in memoised decisions (changes when the model does)."""
    links: LinkProbe | None
    """The probe's figures; ``None`` for a model that was given, not measured."""

    def describe(self) -> str:
        pici, coo = self.model.pici, self.model.coo
        where = self.links.describe() if self.links is not None else f"links not measured ({self.tag})"
        return (
            f"{where}; Pici encode / decode / accumulate {pici.compress / 1e9:.1f} / "
            f"{pici.decompress / 1e9:.1f} / {pici.accumulate / 1e9:.1f} GB/s, COO {coo.compress / 1e9:.1f} / "
            f"{coo.decompress / 1e9:.1f} / {coo.accumulate / 1e9:.1f} GB/s"
        )


def measured_model(transport: P2PTransport, topology: Topology, device: torch.device) -> Measured:
    """The group's measured :class:`CostModel`, with a tag naming it and the probe's figures.

    Probed on the first call per (group, nodes layout, device type); later calls reuse it.
    Collective on that first call: every rank of the group must make it, as every collective call
    does. Figures the probe cannot see keep the defaults.
    """
    per_group = state_of(transport).measured
    key = (topology.ranks_per_node, device.type)
    found = per_group.get(key)
    if found is None:
        base = CostModel.default(device)
        links = probe_links(transport, topology, device)
        slot, sharing, turns = _device_slot(transport, device)
        mine = _in_turn(slot, turns, lambda: codec_costs(device))
        codecs = _shared_codecs(transport, device, mine, sharing)
        model = dataclasses.replace(
            base,
            intra=links.intra or base.intra,
            inter=links.inter or base.inter,
            native=links.native,
            exchange_s=links.exchange_s,
            pici=codecs["pici"],
            coo=codecs["coo"],
        )
        tag = f"measured:{zlib.crc32(model.fingerprint().encode()):08x}"
        found = per_group[key] = Measured(model=model, tag=tag, links=links)
        if transport.rank == 0:
            _log.info("spccl_train: measured a group of %d: %s", transport.world, found.describe())
    return found


def _device_slot(transport: P2PTransport, device: torch.device) -> tuple[int, int, str]:
    """``(this rank's index among the ranks sharing its device, the most ranks any device holds,
    a key naming the device and this probe)``."""
    if device.type == "cuda":
        key = f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}"
    else:
        key = f"{socket.gethostname()}/{device.type}"
    keys: list[str | None] = [None] * transport.world
    dist.all_gather_object(keys, key, group=transport.group)
    _probes[key] = _probes.get(key, 0) + 1  # every rank of the device counts its probes alike
    return keys[: transport.rank].count(key), max(keys.count(k) for k in set(keys)), f"{key}/{_probes[key]}"


_probes: dict[str, int] = {}


def _in_turn(slot: int, key: str, work):
    """Run ``work`` after the ranks before this one on its device have run theirs.

    The wait is on the host, through the rendezvous store: a rank waiting in a collective would run
    a spinning NCCL kernel that time-slices the device with the one calibrating (seen on an H100:
    every codec then measured ~28 GB/s)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # no store to wait on: calibrate at once
        return work()
    if slot:
        store.wait([f"spccl/calibrated/{key}/{slot - 1}"])
    result = work()
    store.set(f"spccl/calibrated/{key}/{slot}", "1")
    return result


def _shared_codecs(
    transport: P2PTransport, device: torch.device, mine: dict[str, CodecCost], sharing: int
) -> dict[str, CodecCost]:
    """Every rank's calibration folded into one: the slowest throughput and call of each, the
    throughputs divided among the ranks that share a device (their codecs run at the same time)."""
    names = ("compress", "decompress", "accumulate", "call_s")
    # throughputs as seconds per byte, so one MAX reduction serves every figure
    values = [1.0 / getattr(mine[f], n) if n != "call_s" else mine[f].call_s for f in ("pici", "coo") for n in names]
    t = torch.tensor(values, dtype=torch.float64, device=transport.exchange_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=transport.group)
    v = t.tolist()
    out = {}
    for i, fmt in enumerate(("pici", "coo")):
        a = v[4 * i : 4 * i + 4]
        out[fmt] = CodecCost(
            compress=1 / a[0] / sharing, decompress=1 / a[1] / sharing, accumulate=1 / a[2] / sharing, call_s=a[3]
        )
    return out


def forget_measured() -> None:
    """Drop every measured model (the next call of each group probes again)."""
    for state in live_states():
        state.measured.clear()
        state.routes.clear()
