"""What the push tests over real NIXL agents in one process share (``tests/test_push_wire.py``,
``tests/test_push_identity.py``): a prefill agent with a KV cache (random values) and a decode agent with a zeroed
one, both registered (:class:`Agents`, the ``agents`` fixture of ``tests/conftest.py``), an in-process side
channel, descriptors of blocks and the decode rank's :class:`handshake.AgentInfo`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from handshake import AgentInfo, HandshakeServer, KVRegion
from p2pkv.dataplane.agent import NixlTransferAgent, unique_agent_name
from p2pkv.dataplane.layout import KVLayout, describe_torch_kv_caches
from p2pkv.dataplane.plan import build_descriptors, coalesce_runs
from p2pkv.testing import make_kv_caches
from p2pkv.tools.doctor import loopback_info
from tests.handshake_support import make_agent_info

HOST = "127.0.0.1"
KEY = b"push-wire-test-secret"
ENGINE = "prefill-engine"  # make_agent_info's engine id: the servers serve rank 0 of it
DECODE = "decode-engine"  # the requester of every push request
NUM_BLOCKS = 16
SHAPE = dict(num_layers=2, num_blocks=NUM_BLOCKS, num_heads=2, block_size=16, head_dim=8)


def decode_info_of(agent: NixlTransferAgent, layout: KVLayout, engine_id: str = DECODE) -> AgentInfo:
    """A decode rank's :class:`AgentInfo` as its worker sends it: rank 0 of ``engine_id``, ``agent``'s real NIXL
    metadata, ``layout``'s segments as its regions."""
    info = loopback_info(agent)
    regions = [KVRegion(base_addr=seg.addr, length=NUM_BLOCKS * seg.block_stride) for seg in layout.segments]
    return msgspec.structs.replace(info, engine_id=engine_id, layout=msgspec.structs.replace(info.layout,
                                                                                            regions=regions))


def descs(layout: KVLayout, ids: list[int]) -> np.ndarray:
    """Descriptor rows of blocks ``ids`` (in order) of ``layout``."""
    starts, _, lengths = coalesce_runs(ids, ids, NUM_BLOCKS, NUM_BLOCKS)
    return build_descriptors(layout.segments, starts, lengths)


@contextlib.contextmanager
def side_channel(on_push: object, secret: bytes | None) -> Iterator[HandshakeServer]:
    """An in-process side channel serving rank 0 of ENGINE with ``on_push`` (None: it takes no pushes)."""
    srv = HandshakeServer(HOST, 0, "compat-test", secret=secret, on_push=on_push,  # type: ignore[arg-type]
                          on_heartbeat=lambda ids, s, b: None, on_release=lambda ids, b, r: 0)
    srv.set_info(make_agent_info(0))
    with srv:
        yield srv


@dataclass
class Agents:
    """A prefill agent with a KV cache (random values), a decode agent with a zeroed one, both registered.

    Attributes:
        source, target: the prefill and the decode cache (``[blocks, ...]``).
        spare: more memory of the decode rank (registered by the tests that need it).
        decode_info: the decode rank's AgentInfo as the agents were made.
    """

    prefill: NixlTransferAgent
    decode: NixlTransferAgent
    layout: KVLayout
    decode_layout: KVLayout
    source: torch.Tensor
    target: torch.Tensor
    spare: torch.Tensor
    decode_info: AgentInfo

    def info(self, staging: list[KVRegion] | None = None) -> AgentInfo:
        """The decode rank's AgentInfo now (its current NIXL metadata), with ``staging``."""
        return msgspec.structs.replace(decode_info_of(self.decode, self.decode_layout), staging=staging or [])


@contextlib.contextmanager
def make_agents() -> Iterator[Agents]:
    """:class:`Agents`, closed on exit."""
    source, views = make_kv_caches("BLHNC", seed=7, **SHAPE)
    target, decode_views = make_kv_caches("BLHNC", fill=0.0, **SHAPE)
    prefill = NixlTransferAgent(unique_agent_name(ENGINE, 0))
    dec = NixlTransferAgent(unique_agent_name(DECODE, 0))
    layout, decode_layout = (describe_torch_kv_caches(v, NUM_BLOCKS) for v in (views, decode_views))
    prefill.register(layout.regions, "DRAM")
    dec.register(decode_layout.regions, "DRAM")
    try:
        yield Agents(prefill, dec, layout, decode_layout, source, target, torch.zeros(1 << 16, dtype=torch.uint8),
                     decode_info_of(dec, decode_layout))
    finally:
        dec.close()
        prefill.close()
