"""Where a side-channel request goes: one rank of one engine, at its side channel's address."""

from __future__ import annotations

from dataclasses import dataclass

from handshake._net import tcp_endpoint

__all__ = ["Destination"]


@dataclass(frozen=True, slots=True)
class Destination:
    """One rank's side channel and the names a request to it carries.

    Every request names ``engine_id`` and ``rank`` as its destination
    (``to_engine_id``, ``to_rank``); the server at ``host:port`` refuses a
    request that names another engine or a rank it does not serve.

    Attributes:
        host: the side channel's host name or address.
        port: its TCP port.
        engine_id: the engine the request is for (a prefill's ``remote_engine_id``).
        rank: the worker the request is for: its rank in its engine, ``pp_rank * tp_size + tp_rank``
            (its tensor-parallel rank without pipeline parallelism; :attr:`handshake.AgentInfo.rank`).
    """

    host: str
    port: int
    engine_id: str
    rank: int

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` (IPv6 literals bracketed)."""
        return tcp_endpoint(self.host, self.port)

    def describe(self) -> str:
        """For messages: ``rank R of 'engine' at host:port``."""
        return f"rank {self.rank} of {self.engine_id[:64]!r} at {self.host}:{self.port}"
