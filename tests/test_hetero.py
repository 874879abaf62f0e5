"""Heterogeneous prefill/decode pairs with real NIXL agents in two processes.

The prefill process runs one :class:`p2pkv.worker.WorkerSide` per prefill
tp_rank; this process runs one per decode tp_rank. Every prefill cache is
filled with position-coded values: the element of (layer, token, global
head, element) holds a unique int32 code, in the prefill side's block
size, HND/NHD order and head split. After the pull every decode rank's
blocks must hold, for every prompt token, exactly the codes of its own
heads in its own block size and order, everything else zero; and every
prefill rank must release the request on notifications alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.negotiate import ModelInfo
from p2pkv.dataplane.topology import heads_per_rank, rank_first_head
from p2pkv.decode.transfer import TransferState
from p2pkv.metadata import LoadSpec, P2pKvMetadata
from p2pkv.params import RemotePrefill
from p2pkv.worker import WorkerSide
from tests.conftest import free_ports
from tests.p2p_harness import PrefillProc

LAYERS, HEAD_DIM, NUM_BLOCKS = 2, 4, 40


@dataclass(frozen=True)
class Side:
    """One engine's KV shape: block size, HND/NHD, TP size, total KV heads, MLA."""

    block_size: int
    attn_layout: str = "HND"
    tp_size: int = 1
    num_kv_heads: int = 4
    is_mla: bool = False
    cross_layer: bool = False

    def heads(self) -> int:
        return 1 if self.is_mla else self.num_kv_heads

    def rank_heads(self, rank: int) -> list[int]:
        first = rank_first_head(rank, self.heads(), self.tp_size)
        return list(range(first, first + heads_per_rank(self.heads(), self.tp_size)))


def code(layer: int, token: int, head: int, elem: int) -> int:
    return 1 + ((layer * 8 + head) * 4096 + token) * HEAD_DIM + elem


def make_cache(side: Side, rank: int, device: str = "cpu", block_ids: list[int] | None = None,
               tokens: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """int32 storage and per-layer float32 views ``[blocks, *page]`` on ``device``, zero except the
    codes of ``tokens`` prompt tokens in ``block_ids`` when given."""
    h, n = len(side.rank_heads(rank)), side.block_size
    page = {"HND": (h, n, HEAD_DIM), "NHD": (n, h, HEAD_DIM), "CPU": (h, n, 2 * HEAD_DIM)}[side.attn_layout]
    shape = (NUM_BLOCKS, LAYERS, *page) if side.cross_layer else (LAYERS, NUM_BLOCKS, *page)
    base = torch.zeros(shape, dtype=torch.int32)
    if block_ids is not None:
        fill(side, rank, _views(base, side), block_ids, tokens)
    base = base.to(device)
    return base, _views(base, side)


def _views(base: torch.Tensor, side: Side) -> dict[str, torch.Tensor]:
    if side.cross_layer:
        return {f"layer.{li}": base[:, li].view(torch.float32) for li in range(LAYERS)}
    return {f"layer.{li}": base[li].view(torch.float32) for li in range(LAYERS)}


def fill(side: Side, rank: int, views: dict[str, torch.Tensor], block_ids: list[int], tokens: int,
         first: int = 0) -> None:
    """Write the codes of prompt tokens ``first .. first + tokens - 1`` into ``block_ids`` from slot 0
    (this rank's heads)."""
    for li, view in enumerate(views.values()):
        ints = view.view(torch.int32)
        for t in range(tokens):
            b, s = block_ids[t // side.block_size], t % side.block_size
            for j, g in enumerate(side.rank_heads(rank)):
                row = torch.tensor([code(li, first + t, g, e) for e in range(HEAD_DIM)], dtype=torch.int32)
                if side.attn_layout == "HND":
                    ints[b, j, s] = row
                elif side.attn_layout == "NHD":
                    ints[b, s, j] = row
                else:  # vLLM CPU attention: per head K as [head_dim, block_size], then V as [block_size, head_dim]
                    head = ints[b, j].reshape(-1)
                    n = side.block_size
                    head[: n * HEAD_DIM].view(HEAD_DIM, n)[:, s] = row
                    head[n * HEAD_DIM:].view(n, HEAD_DIM)[s] = -row


def model_info(side: Side, rank: int) -> ModelInfo:
    return ModelInfo(kv_layout="BLHNC" if side.cross_layer else "LBHNC", attn_layout=side.attn_layout,
                     dtype="float32", num_kv_heads=len(side.rank_heads(rank)), head_dim=HEAD_DIM,
                     block_size=side.block_size, total_num_kv_heads=side.heads(), is_mla=side.is_mla)


def make_workers(engine: str, side: Side, base_port: int, device: str = "cpu", block_ids: list[int] | None = None,
                 tokens: int = 0, staging_mib: float = 4,
                 **settings: object) -> list[tuple[WorkerSide, torch.Tensor, dict]]:
    """One WorkerSide per rank of ``side`` (``settings``: more :class:`P2pKvConfig` fields; insecure unless they
    name a secret), each with its cache from :func:`make_cache`."""
    out = []
    settings.setdefault("insecure", "secret" not in settings)
    for rank in range(side.tp_size):
        config = P2pKvConfig(side_channel_host="127.0.0.1", side_channel_port=base_port, staging_mib=staging_mib,
                             **settings)
        worker = WorkerSide(engine, config, rank, side.tp_size, "127.0.0.1", base_port + rank, "compat",
                            model_info(side, rank))
        base, views = make_cache(side, rank, device, block_ids, tokens)
        worker.register_kv_caches(views, NUM_BLOCKS)
        out.append((worker, base, views))
    return out


RIDS = ("req-0", "req-1", "req-2")
"""More request ids the prefill process holds (same blocks), for several pulls in one test."""


def prefill_ranks(side: Side, device: str, block_ids: list[int], tokens: int,
                  port: int) -> list[tuple[WorkerSide, object]]:
    """The prefill ranks of ``side`` (:data:`tests.p2p_harness.Ranks`), their caches holding the position codes of
    ``tokens`` prompt tokens in ``block_ids``."""
    return [(worker, (base, views)) for worker, base, views in make_workers("prefill", side, port, device, block_ids,
                                                                            tokens)]


ROWS = {  # name: (prefill, decode, how the decode ranks pull)
    "block 16 -> 32": (Side(16), Side(32), "staged"),
    "block 16 -> 64": (Side(16), Side(64), "staged"),
    "block 64 -> 16": (Side(64), Side(16), "staged"),
    "block 32 -> 16": (Side(32), Side(16), "staged"),
    "HND -> NHD": (Side(16, "HND"), Side(16, "NHD"), "staged"),
    "NHD -> HND": (Side(16, "NHD"), Side(16, "HND"), "staged"),
    "TP 1 -> 2": (Side(16, tp_size=1), Side(16, tp_size=2), "paged"),
    "TP 2 -> 1": (Side(16, tp_size=2), Side(16, tp_size=1), "paged"),
    "TP 2 -> 1, NHD": (Side(16, "NHD", tp_size=2), Side(16, "NHD", tp_size=1), "staged"),
    "TP 2 block 32 HND -> TP 1 block 16 NHD": (Side(32, "HND", tp_size=2), Side(16, "NHD", tp_size=1), "staged"),
    "cross-layer -> layer-compact": (Side(16, cross_layer=True), Side(16), "paged"),
    "cross-layer block 16 -> layer-compact block 32": (Side(16, cross_layer=True), Side(32), "staged"),
    "GQA 2 heads TP 4 (replicated) -> TP 1, block 16 -> 32": (
        Side(16, tp_size=4, num_kv_heads=2), Side(32, tp_size=1, num_kv_heads=2), "staged"),
    "GQA 2 heads TP 1 -> TP 4 (replicated), NHD": (
        Side(16, "NHD", num_kv_heads=2), Side(16, "NHD", tp_size=4, num_kv_heads=2), "staged"),
    "GQA 2 heads TP 1 -> TP 4 (replicated), HND": (
        Side(16, num_kv_heads=2), Side(16, tp_size=4, num_kv_heads=2), "paged"),
    "CPU attention block 32 -> 64": (Side(32, "CPU"), Side(64, "CPU"), "staged"),
    "CPU attention block 64 -> 32, TP 1 -> 2": (Side(64, "CPU"), Side(32, "CPU", tp_size=2), "staged"),
    "CPU attention TP 2 -> 1": (Side(32, "CPU", tp_size=2), Side(32, "CPU"), "paged"),
    "CPU attention block 64 -> 32": (Side(64, "CPU"), Side(32, "CPU"), "staged"),
    "CPU attention TP 1 -> 2": (Side(32, "CPU"), Side(32, "CPU", tp_size=2), "paged"),
    "CPU attention TP 2 block 32 -> TP 1 block 64": (Side(32, "CPU", tp_size=2), Side(64, "CPU"), "staged"),
    "MLA TP 2 -> TP 1": (Side(32, "NHD", tp_size=2, is_mla=True), Side(32, "NHD", is_mla=True), "direct"),
    "MLA TP 2 -> TP 1, block 32 -> 16": (Side(32, "NHD", tp_size=2, is_mla=True), Side(16, "NHD", is_mla=True),
                                         "staged"),
}


def mode(worker: WorkerSide) -> set[str]:
    """How ``worker`` pulls from the prefill ranks it reads."""
    return {p.plan.placement.value for p in worker.receiver.peers.peers.values() if p.plan.read.num_heads}


@pytest.mark.parametrize("row", list(ROWS))
def test_every_token_lands_in_the_right_slot_of_the_right_rank(row: str) -> None:
    pull_and_check(row, "cpu")


VLLM_CPU_ROWS = ["CPU attention block 32 -> 64", "CPU attention block 64 -> 32", "CPU attention TP 2 -> 1",
                 "CPU attention TP 1 -> 2", "CPU attention TP 2 block 32 -> TP 1 block 64"]
"""The pairings of block size and TP size between engines of vLLM's CPU attention layout, in push mode too:
the prefill ranks WRITE into the decode ranks' blocks, or into their staging when a fixup follows."""


@pytest.mark.parametrize("row", VLLM_CPU_ROWS)
def test_every_token_lands_in_the_right_slot_when_pushed(row: str) -> None:
    pull_and_check(row, "cpu", transfer_mode="push")


GPU_ROWS = ["block 16 -> 64", "block 64 -> 16", "HND -> NHD", "TP 1 -> 2", "TP 2 -> 1, NHD",
            "TP 2 block 32 HND -> TP 1 block 16 NHD", "GQA 2 heads TP 1 -> TP 4 (replicated), NHD"]


@pytest.mark.gpu
@pytest.mark.parametrize("row", GPU_ROWS)
def test_every_token_lands_in_the_right_slot_on_cuda(row: str) -> None:
    """The same on GPU memory: NIXL VRAM registration, staging on the GPU, the CUDA fixup."""
    pull_and_check(row, "cuda")


VERIFIED_ROWS = [("block 16 -> 64", "pull"), ("TP 1 -> 2", "pull"), ("TP 2 -> 1", "pull"), ("HND -> NHD", "pull"),
                 ("MLA TP 2 -> TP 1", "pull"), ("cross-layer -> layer-compact", "pull"),
                 ("CPU attention TP 2 -> 1", "push"), ("CPU attention block 32 -> 64", "push")]
"""Every placement (staged before its fixup, head slices into pages, whole pages) in both ways that land rows."""


@pytest.mark.parametrize(("row", "transfer_mode"), VERIFIED_ROWS)
def test_verified_kv_passes_every_placement(row: str, transfer_mode: str) -> None:
    """With ``verify_kv``, every part of a heterogeneous pairing is checked against its prefill rank's digest
    (staged parts before their fixup) and verified: no false mismatch, the same bytes as unverified."""
    pull_and_check(row, "cpu", transfer_mode=transfer_mode, verify_kv=True)


@pytest.mark.parametrize(("row", "cap", "expect"), [("TP 2 -> 1", 8, "push"), ("block 16 -> 64", 0, "pull")])
def test_parts_longer_than_a_push_request_are_cut_and_staged_ones_read(row: str, cap: int, expect: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Push mode with a push request's row cap (``MAX_PUSH_ROWS``) made small: a part into local pages (TP 2 -> 1,
    head slices, many rows) is pushed in several requests; a staged part, fixed up whole, is READ instead."""
    monkeypatch.setattr("p2pkv.decode.movers.MAX_PUSH_ROWS", cap)
    pull_and_check(row, "cpu", transfer_mode="push", expect=expect)


@pytest.mark.gpu
def test_auto_chooses_by_the_probe_before_the_first_request_on_cuda() -> None:
    """GPU memory: the probe READ after the handshake tells ``auto`` how UCX moves READs of VRAM (over TCP
    without an NVLink peer, unless cuda_ipc GET is on), and the first request already goes that way."""
    pull_and_check("block 16 -> 64", "cuda", transfer_mode="auto")


def probed_choice(worker: WorkerSide) -> str:
    """The direction ``auto`` chose for a decode worker's one prefill agent, which its probe READ decided."""
    (choice,) = worker.receiver.directions.choices.values()
    assert not choice.reason.startswith("auto: no READ"), choice.reason  # decided before the first request
    return choice.direction.value


def block_ids(rng: np.random.Generator, count: int) -> list[int]:
    """``count`` distinct block ids: a run of consecutive ids (as an allocator hands out), then scattered ones."""
    run = count // 2
    start = int(rng.integers(0, NUM_BLOCKS - run))
    rest = [int(b) for b in rng.permutation(NUM_BLOCKS) if not start <= b < start + run]
    return list(range(start, start + run)) + rest[: count - run]


@contextlib.contextmanager
def running_prefill(side: Side, block_ids: list[int], tokens: int, device: str) -> Iterator[PrefillProc]:
    """A prefill process (:class:`tests.p2p_harness.PrefillProc`) serving request ``req`` and :data:`RIDS`
    (``tokens`` prompt tokens in ``block_ids``), every rank ready; stopped on exit."""
    pf = PrefillProc(free_ports(1, run=side.tp_size)[0],
                     ranks=functools.partial(prefill_ranks, side, device, block_ids, tokens))
    pf.start({rid: 120.0 for rid in ("req", *RIDS)})
    try:
        yield pf
    finally:
        pf.stop()


@contextlib.contextmanager
def decode_workers(side: Side, device: str, **config: float) -> Iterator[list[tuple[WorkerSide, torch.Tensor, dict]]]:
    """One decode WorkerSide per rank of ``side`` (see :func:`make_workers`), shut down on exit."""
    workers: list[tuple[WorkerSide, torch.Tensor, dict]] = []
    try:
        workers = make_workers("decode", side, free_ports(1, run=side.tp_size)[0], device, **config)
        yield workers
    finally:
        for worker, _, _ in workers:
            worker.shutdown()


def pull_and_check(row: str, device: str, transfer_mode: str = "pull", expect: str | None = None,
                   verify_kv: bool = False) -> None:
    """Move one 150-token request between the row's engines (``transfer_mode``: the decode ranks READ, or the
    prefill ranks WRITE, or ``auto``: as each decode rank's probe READ decided; ``expect``: the direction the
    transfers must have taken, if not that; ``verify_kv``: the decode ranks check every part's digest, each
    part counted verified) and compare every decode rank's cache."""
    prefill_side, decode_side, how = ROWS[row]
    tokens, first_token = 150, 0
    rng = np.random.default_rng(len(row))
    remote_ids = block_ids(rng, -(-tokens // prefill_side.block_size))
    local_ids = block_ids(rng, -(-tokens // decode_side.block_size))
    with running_prefill(prefill_side, remote_ids, tokens, device) as prefill, \
            decode_workers(decode_side, device, verify_kv=verify_kv) as decoders:
        remote = RemotePrefill("prefill", "req", "127.0.0.1", prefill.port, tuple(remote_ids), prefill_side.tp_size,
                               transfer_mode=transfer_mode)
        task = LoadSpec("d-req", tuple(local_ids), tuple(remote_ids), remote, first_token=first_token,
                        num_tokens=tokens)
        for worker, _, _ in decoders:
            worker.start_load_kv(P2pKvMetadata(loads=[task]))
        pending = set(range(len(decoders)))
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                _, recving = decoders[rank][0].get_finished()
                if "d-req" in recving:
                    assert decoders[rank][0].get_block_ids_with_load_errors() == set(), f"rank {rank} failed"
                    pending.discard(rank)
            time.sleep(0.002)
        assert not pending, f"decode ranks {pending} never finished"
        assert all(mode(w) == {how} for w, _, _ in decoders), [mode(w) for w, _, _ in decoders]
        for rank, (worker, _, _) in enumerate(decoders):
            stats = worker.take_stats() or {}
            expected = expect or (probed_choice(worker) if transfer_mode == "auto" else transfer_mode)
            assert stats.get("directions", {}) == {expected: 1}, f"decode rank {rank}: {stats.get('directions')}"
            checks = stats.get("kv_checks", {})
            if verify_kv:  # at least one part per prefill rank read (a long push is cut into several)
                read = sum(1 for p in worker.receiver.peers.peers.values() if p.plan.read.num_heads)
                assert set(checks) == {f"{expected}:verified"}, f"decode rank {rank}: {checks}"
                assert checks[f"{expected}:verified"] >= read, f"decode rank {rank}: {checks}"
            else:
                assert checks == {}, f"decode rank {rank}: {checks}"
        for rank, (_, base, _) in enumerate(decoders):
            expected, _ = make_cache(decode_side, rank, "cpu", local_ids, tokens)
            assert torch.equal(base.cpu(), expected), f"decode rank {rank}: blocks differ from the position codes"
        end = time.monotonic() + 20
        while len(prefill.released_by_rank) < prefill_side.tp_size and time.monotonic() < end:
            for worker, _, _ in decoders:  # vLLM steps on (the request decodes): each step progresses NIXL's sends
                worker.get_finished()
            prefill.drain(0.02)
        prefill.drain(0.05)
        assert prefill.expired == {}
        assert prefill.released_by_rank == {r: ["req"] for r in range(prefill_side.tp_size)}


def test_staging_full_waits_and_too_large_fails(caplog) -> None:
    """64 KiB of staging: 2 KiB per staged block. Three 12-block pulls (24 KiB each) cannot all be
    staged at once, so one waits and all three land; a 40-block pull (80 KiB) can never fit and fails
    with kind=staging, its blocks reported as load errors."""
    prefill_side, decode_side = Side(16), Side(32)
    tokens = NUM_BLOCKS * 16
    remote_ids = list(range(NUM_BLOCKS))
    with running_prefill(prefill_side, remote_ids, tokens, "cpu") as prefill, \
            decode_workers(decode_side, "cpu", staging_mib=0.0625) as decoders:
        worker, base, _ = decoders[0]
        remote = RemotePrefill("prefill", "req", "127.0.0.1", prefill.port, tuple(remote_ids), 1)
        small = [LoadSpec(f"d-{i}", tuple(range(6 * i, 6 * i + 6)), tuple(remote_ids[12 * i:12 * i + 12]),
                          dataclasses.replace(remote, request_id=RIDS[i]), num_tokens=192) for i in range(3)]
        worker.start_load_kv(P2pKvMetadata(loads=small))
        done: set[str] = set()
        waited: set[str] = set()
        deadline = time.monotonic() + 60
        while len(done) < 3 and time.monotonic() < deadline:
            worker.start_load_kv(P2pKvMetadata())
            done |= worker.get_finished()[1]
            waited |= {p.request_id for p in worker.receiver.in_state(TransferState.STAGING)}
            time.sleep(0.002)
        assert done == {"d-0", "d-1", "d-2"} and worker.get_block_ids_with_load_errors() == set()
        assert waited == {"d-2"}  # two 24 KiB pulls staged at once, the third waited for room
        expected, views = make_cache(decode_side, 0)
        for i in range(3):  # pull i moved prompt tokens 192i.. (prefill blocks 12i..) into local blocks 6i..6i+5
            fill(decode_side, 0, views, list(range(6 * i, 6 * i + 6)), 192, first=192 * i)
        assert torch.equal(base, expected)
        big = LoadSpec("d-big", tuple(range(20, 40)), tuple(remote_ids), remote, num_tokens=tokens)
        worker.start_load_kv(P2pKvMetadata(loads=[big]))
        deadline = time.monotonic() + 30
        while "d-big" not in worker.get_finished()[1] and time.monotonic() < deadline:
            time.sleep(0.002)
        assert worker.get_block_ids_with_load_errors() == set(range(20, 40))
        assert "kind=staging" in caplog.text and "staging_mib" in caplog.text
        assert torch.equal(base, expected)  # nothing was read for the refused pull
        assert worker.receiver is not None and worker.receiver.stager.idle
