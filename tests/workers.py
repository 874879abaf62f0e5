"""Worker-level test helpers: synthetic-cache WorkerSides, pull specs (a prefill process: :mod:`tests.p2p_harness`)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from handshake import KVLayoutDesc, KVRegion
from handshake.fingerprints import fingerprint
from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.negotiate import ModelInfo
from p2pkv.metadata import LoadSpec
from p2pkv.params import RemotePrefill
from p2pkv.worker import WorkerSide

NUM_BLOCKS = 64
SHAPE = dict(num_layers=4, num_blocks=NUM_BLOCKS, num_heads=2, block_size=32, head_dim=16)
COMPAT_FIELDS = {"vllm": "0.32", "architecture": "Synthetic", "kv_cache_dtype": "auto"}
"""The compatibility fields every synthetic worker publishes (see :mod:`handshake.fingerprints`)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the ephemeral range (see :func:`tests.conftest.free_ports`)."""
    from tests.conftest import free_ports

    return free_ports(1, run=1)[0]


def one_layer_desc(block_size: int) -> KVLayoutDesc:
    """The wire layout of a one-layer HND cache: 2 KV heads of 16 float32 elements, 8 blocks of ``block_size``."""
    block_len = 2 * block_size * 2 * 16 * 4
    return KVLayoutDesc(kv_layout="LBHNC", attn_layout="HND", dtype="float32", num_layers=1, num_kv_heads=2,
                        head_dim=16, block_size=block_size, num_blocks=8, block_len=block_len,
                        block_stride=block_len, mem_type="DRAM",
                        regions=[KVRegion(base_addr=4096, length=8 * block_len, device_id=0, layer_start=0,
                                          num_layers=1, kv_index=-1)])


def model_info(layout: str) -> ModelInfo:
    return ModelInfo(kv_layout=layout, dtype="float32", num_kv_heads=2, head_dim=16, block_size=32, attn_layout="HND")


def make_worker(engine_id: str, port: int, layout: str = "BLHNC", handshake_attempts: int | None = None,
                **cfg) -> WorkerSide:
    """A rank-0 :class:`WorkerSide` on loopback with settings ``cfg``; ``handshake_attempts``: what its handshakes
    make instead of :data:`p2pkv.decode.peers.HANDSHAKE_ATTEMPTS` (1: a dead peer fails fast)."""
    cfg.setdefault("insecure", "secret" not in cfg)  # synthetic caches on loopback; secured pairs: tests pass one
    config = P2pKvConfig(side_channel_host="127.0.0.1", side_channel_port=port, **cfg)
    worker = WorkerSide(engine_id, config, 0, 1, "127.0.0.1", port, fingerprint(COMPAT_FIELDS), model_info(layout))
    if handshake_attempts is not None:
        set_handshake_attempts(worker, handshake_attempts)
    return worker


def set_handshake_attempts(worker: WorkerSide, attempts: int) -> None:
    """Make ``worker``'s handshakes ``attempts`` attempts each, once its receiver exists (it is built when its KV
    caches are registered)."""
    register = worker.register_kv_caches

    def registered(*args: Any, **kwargs: Any) -> None:
        register(*args, **kwargs)
        if worker.receiver is not None:
            worker.receiver.keeper.attempts = attempts

    worker.register_kv_caches = registered  # type: ignore[method-assign]


def run_until_received(worker: WorkerSide, request_id: str, timeout_s: float = 30) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, recving = worker.get_finished()
        if request_id in recving:
            return worker.get_block_ids_with_load_errors()
        time.sleep(0.002)
    raise AssertionError(f"{request_id} never finished receiving")


def task(request_id: str, remote_request: str, port: int, local: list[int], remote: list[int]) -> LoadSpec:
    rp = RemotePrefill("prefill-engine", remote_request, "127.0.0.1", port, tuple(remote), 1)
    return LoadSpec(request_id, tuple(local), tuple(remote), rp)




def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds (user + system) a thread of this process has used, from ``/proc`` (Linux)."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_s(threads: list[threading.Thread], seconds: float = 1.0) -> float:
    """CPU seconds ``threads`` use together over ``seconds`` of wall time (a worker with nothing to do: ~0)."""
    before = sum(map(thread_cpu_s, threads))
    time.sleep(seconds)
    return sum(map(thread_cpu_s, threads)) - before
