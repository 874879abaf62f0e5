"""Helpers for tests that need a valid AgentInfo for a real NIXL agent."""

from __future__ import annotations

from handshake import AgentInfo, KVLayoutDesc, KVRegion, compute_digest
from p2pkv.transfer import NixlTransferAgent


def agent_info_for(agent: NixlTransferAgent) -> AgentInfo:
    """An AgentInfo carrying ``agent``'s real metadata (layout fields are placeholders)."""
    meta = agent.metadata()
    layout = KVLayoutDesc(kv_layout="BLHNC", attn_layout="HND", dtype="float32", num_layers=1, num_kv_heads=1,
                          head_dim=1, block_size=1, num_blocks=1, block_len=4, block_stride=4, mem_type="DRAM",
                          regions=[KVRegion(base_addr=0, length=4)])
    return AgentInfo(engine_id="e", tp_rank=0, tp_size=1, agent_name=agent.name, agent_metadata=meta,
                     metadata_digest=compute_digest(meta), compat_hash="c", layout=layout)
