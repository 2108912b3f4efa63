"""Emulated nodes: one host (even one GPU) behaving as several nodes joined by a slow network.

NCCL decides that two ranks share a host from a host hash that ``NCCL_HOSTID`` overrides. Giving
each group of local ranks its own value, before the process group is made, makes NCCL carry the
traffic between groups over its network transport (sockets on the loopback interface), while
ranks of one group keep NVLink / shared memory. It works with several ranks on one GPU too (NCCL's
duplicate-GPU check is per host). The library's topology is told the same grouping through
``SPCCL_RANKS_PER_NODE``, so thresholds and the cost model see inter-node hops where NCCL does.

What it emulates: the shape of a cluster (fast links inside a node, a network between nodes of
roughly 1-2 GB/s per rank over loopback sockets) and the host synchronisations and latencies of
a real network path. What it does not: ranks that share a GPU also share its compute and memory
bandwidth, so compute and codec times are inflated by the sharing; loopback sockets are not a
NIC (no RDMA, different latency); and the socket bandwidth depends on the host's CPUs
(``NCCL_SOCKET_NTHREADS``, ``NCCL_NSOCKS_PERTHREAD`` change it).

::

    spccl-train --config configs/gpt2_xl_spccl.yaml dist.emulate_nodes=2   # under torchrun
    launch/torchrun.sh --emulate-nodes 2 configs/gpt2_xl_spccl.yaml        # the same
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping, MutableMapping

__all__ = ["EmulatedNodes", "check_launch", "node_env", "emulate_nodes"]


@dataclasses.dataclass(frozen=True, slots=True)
class EmulatedNodes:
    """Where this rank sits among the emulated nodes of its host."""

    nodes: int
    """Emulated nodes on this host."""
    ranks_per_node: int
    """Local ranks per emulated node."""
    node: int
    """This rank's emulated node."""

    def describe(self) -> str:
        return f"{self.nodes} emulated nodes x {self.ranks_per_node} ranks (this rank on node {self.node})"


def node_env(
    local_rank: int, local_world: int, nodes: int, inherited: Mapping[str, str] | None = None
) -> tuple[EmulatedNodes, dict[str, str]]:
    """The environment that puts ``local_rank`` of ``local_world`` on its emulated node.

    Local ranks ``[k * local_world / nodes, (k + 1) * local_world / nodes)`` form node ``k``.
    ``inherited`` is the environment the rank starts with (default ``os.environ``): socket and
    transport settings the user gave are kept.
    """
    inherited = os.environ if inherited is None else inherited
    for name, value in (("nodes", nodes), ("local_world", local_world)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"emulated nodes: {name}={value!r} must be a positive int")
    if local_world % nodes:
        raise ValueError(
            f"emulated nodes: {local_world} local ranks do not split into {nodes} equal nodes; pick a number of "
            f"nodes that divides {local_world} (e.g. {', '.join(str(d) for d in _divisors(local_world))})"
        )
    if not 0 <= local_rank < local_world:
        raise ValueError(f"emulated nodes: local rank {local_rank} is outside 0..{local_world - 1}")
    per_node = local_world // nodes
    node = local_rank // per_node
    host = socket.gethostname()
    env = {
        "NCCL_HOSTID": f"{host}-spccl-node{node}",
        "SPCCL_RANKS_PER_NODE": str(per_node),
        "SPCCL_EMULATED_NODES": str(nodes),
        # NCCL's network transport between the emulated nodes: TCP sockets on loopback (not an IB
        # NIC's loopback, which would be a fast network), and never NVLink multicast.
        "NCCL_SOCKET_IFNAME": inherited.get("NCCL_SOCKET_IFNAME", "lo"),
        "NCCL_IB_DISABLE": inherited.get("NCCL_IB_DISABLE", "1"),
        "NCCL_NVLS_ENABLE": "0",
        "GLOO_SOCKET_IFNAME": inherited.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    return EmulatedNodes(nodes=nodes, ranks_per_node=per_node, node=node), env


def emulate_nodes(nodes: int, environ: MutableMapping[str, str] | None = None) -> EmulatedNodes | None:
    """Put this process on its emulated node: set the environment from ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (torchrun's, or the trainer's own launch). Call it before the process
    group is made. ``nodes`` of 1 or less changes nothing and returns ``None``.
    """
    environ = os.environ if environ is None else environ
    if nodes <= 1:
        return None
    try:
        local_rank = int(environ["LOCAL_RANK"])
        local_world = int(environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        raise ValueError(
            "emulated nodes need LOCAL_RANK and LOCAL_WORLD_SIZE (start the ranks with torchrun or spccl-train's "
            "own launch)"
        ) from None
    placed, env = node_env(local_rank, local_world, nodes, environ)
    environ.update(env)
    return placed


def check_launch(nodes: int, local_world: int, world: int, ranks_per_node: int = 0) -> str | None:
    """What is wrong with emulating ``nodes`` nodes on a launch of ``local_world`` ranks on this
    host and ``world`` in all (``ranks_per_node``: the config's, 0 for none), or ``None``.

    For the launcher to say once, before any rank starts, what every rank would raise.
    """
    if nodes <= 1:
        return None
    if world != local_world:
        return (
            f"dist.emulate_nodes={nodes} emulates nodes on one host, but this launch spans hosts ({world} ranks, "
            f"{local_world} on this one): the emulated nodes talk over loopback sockets and could not reach the other "
            "hosts; leave dist.emulate_nodes at 0 on a real cluster"
        )
    if local_world % nodes:
        return (
            f"dist.emulate_nodes={nodes} does not split {local_world} ranks into equal nodes; pick a number of nodes "
            f"that divides {local_world} (e.g. {', '.join(str(d) for d in _divisors(local_world))}) or change the rank count"
        )
    if ranks_per_node not in (0, local_world // nodes):
        return (
            f"dist.ranks_per_node={ranks_per_node} contradicts dist.emulate_nodes={nodes} ({local_world // nodes} ranks "
            "per emulated node): leave dist.ranks_per_node at 0"
        )
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
