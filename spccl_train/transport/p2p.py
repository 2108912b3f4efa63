"""Moving planned byte buffers between the ranks of a ``torch.distributed`` group.

The transport knows nothing of formats: it moves uint8 tensors whose sizes both sides already
agree on (the plan), so no size ever travels with a message. Ring steps use batched
``isend`` / ``irecv``; the direct algorithm uses ``all_to_all_single`` with planned split sizes
and ``all_gather`` of equal-size slots. The same code runs on gloo (CPU tensors) and NCCL (CUDA
tensors: every call is enqueued on NCCL's streams and ``Work.wait()`` only orders the current
stream after it, so nothing here synchronises the host).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .dense import all_gather_flat

__all__ = ["P2PTransport"]

# Device types each single-device backend moves with point-to-point calls as well as collectives.
_BACKEND_DEVICES = {"nccl": {"cuda"}, "gloo": {"cpu"}, "mpi": {"cpu"}, "ucc": {"cpu", "cuda"}, "xccl": {"xpu"}}


class P2PTransport:
    """Byte-buffer movement over one process group (``None``: the default group).

    Peers are group ranks; the transport maps them to the global ranks torch.distributed's
    point-to-point calls take.

    Example::

        >>> t = P2PTransport()
        >>> works = t.send_recv([(right, payload)], [(left, landing)])
        >>> for w in works: w.wait()
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
        self._group = weakref.ref(group if group is not None else dist.group.WORLD)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group; pass a group it belongs to")
        self.world = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world)]
        self._devices = _devices_of(self.backend)

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The default group's rank of each member, in this group's order."""
        return tuple(self._global)

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group (held weakly, so a cached transport never keeps a destroyed group alive)."""
        group = self._group()
        if group is None:
            raise RuntimeError("the process group of this transport was destroyed; make a new transport")
        return group

    def supports(self, device: torch.device) -> bool:
        """True when this group's backend moves tensors on ``device`` point to point."""
        return self._devices is None or device.type in self._devices

    def exchange_device(self, preferred: torch.device) -> torch.device:
        """Where the planning exchange runs: ``preferred`` if the backend takes it, else one it does."""
        if self.supports(preferred):
            return preferred
        if self.supports(torch.device("cuda")) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Gather one equal-length 1-D row from every rank: a ``(world, len)`` tensor (waits for it)."""
        out = torch.empty(self.world * row.numel(), dtype=row.dtype, device=row.device)
        all_gather_flat(out, row, group=self.group)
        return out.view(self.world, row.numel())

    def send_recv(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> list[dist.Work]:
        """Post the sends and receives of one step as one batch; return their works (empty if none).

        Empty buffers are skipped: the plan gives both sides the same zero, so they skip alike.
        """
        ops = [dist.P2POp(dist.isend, buf, self._global[peer], self.group) for peer, buf in sends if buf.numel()]
        ops += [dist.P2POp(dist.irecv, buf, self._global[peer], self.group) for peer, buf in recvs if buf.numel()]
        return dist.batch_isend_irecv(ops) if ops else []

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]
    ) -> dist.Work | None:
        """One ``all_to_all_single``: ``in_splits[d]`` bytes to rank ``d``, ``out_splits[q]`` from ``q``."""
        if not any(in_splits) and not any(out_splits):
            return None
        return dist.all_to_all_single(
            out,
            inp,
            output_split_sizes=list(out_splits),
            input_split_sizes=list(in_splits),
            group=self.group,
            async_op=True,
        )

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> dist.Work | None:
        """Gather equal-size ``inp`` from every rank into ``out`` (rank ``q`` at ``q * inp.numel()``)."""
        if not inp.numel():
            return None
        return all_gather_flat(out, inp, group=self.group, async_op=True)


def _devices_of(backend: str) -> set[str] | None:
    """Device types of a backend string such as ``"nccl"`` or ``"cpu:gloo,cuda:nccl"`` (None: unknown)."""
    if ":" in backend:
        return {part.split(":", 1)[0].strip() for part in backend.split(",") if ":" in part}
    return _BACKEND_DEVICES.get(backend.lower())
