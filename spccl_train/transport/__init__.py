"""How bytes move between ranks: :class:`P2PTransport` over ``torch.distributed``.

The collectives layer plans every message (format and size); a transport only moves byte
buffers of the planned sizes. See ``docs/ARCHITECTURE.md`` ("Transports").
"""

from .p2p import P2PTransport

__all__ = ["P2PTransport"]
