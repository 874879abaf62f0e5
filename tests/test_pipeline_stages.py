"""A pipeline-parallel prefill engine's stages move their layers into a decode engine's, over real NIXL agents.

The prefill process runs one :class:`p2pkv.worker.WorkerSide` per (stage, tp_rank), role ``prefill``, each
registering only its stage's layers (named ``model.layers.<i>.self_attn.attn`` as vLLM names them) and serving
on ``port + pp_rank * tp_size + tp_rank``; this process runs one decode WorkerSide per decode tp_rank holding
every layer. Every cache element holds a code unique to (model layer, token, global head, element). After the
load each decode rank must hold exactly the codes of its own heads for every layer and prompt token (another
stage's layers in a stage's place, or a layer left out, show as wrong codes or zeros), and every prefill worker
of every stage must release the request on notifications alone. vLLM's CPU build cannot run a PP engine's
forward (``tests/test_pipeline_parallel.py``), so the stages' caches are built here, shaped as vLLM allocates
them per stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.negotiate import ModelInfo, Placement
from p2pkv.decode import progress as pull_progress
from p2pkv.metadata import LoadSpec, P2pKvMetadata
from p2pkv.params import RemotePrefill
from p2pkv.worker import WorkerSide
from tests.conftest import free_ports
from tests.p2p_harness import PrefillProc
from tests.test_stream_hetero import SECRET, forward_streamed, granted_stream, release_prefills
from tests.workers import set_handshake_attempts

LAYERS, HEADS, HEAD_DIM, NUM_BLOCKS, TOKENS = 4, 4, 4, 40, 150
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Pair:
    """A PP prefill engine and a decode engine: layers per stage, TP sizes, block sizes, decode layout."""

    stages: tuple[int, ...] = (2, 2)
    """Layers of each pipeline stage of the prefill engine, in stage order (uneven splits allowed)."""
    prefill_tp: int = 1
    """Tensor-parallel ranks of each prefill stage."""
    decode_tp: int = 1
    """Tensor-parallel ranks of the decode engine."""
    block_size: int = 16
    """Tokens per block of the prefill cache."""
    decode_block_size: int = 16
    """Tokens per block of the decode cache (another size: staged)."""
    cross_layer: bool = False
    """The decode cache is cross-layer (``BLHNC``: one block holds every layer's page)."""
    device: str = "cpu"
    """Where both engines' caches lie (``cuda``: NIXL VRAM registration)."""

    def stage_layers(self) -> list[range]:
        """Model layers of each stage, in stage order."""
        out, first = [], 0
        for n in self.stages:
            out.append(range(first, first + n))
            first += n
        return out


def code(layer: int, token: int, head: int, elem: int) -> int:
    return 1 + ((layer * 8 + head) * 4096 + token) * HEAD_DIM + elem


def rank_heads(rank: int, tp: int) -> range:
    per = HEADS // tp
    return range(rank * per, (rank + 1) * per)


def make_cache(layers: range, rank: int, tp: int, block_size: int, cross_layer: bool = False,
               block_ids: list[int] | None = None, device: str = "cpu",
               tokens: int = TOKENS) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """int32 storage of ``layers`` (HND pages of rank ``rank``'s heads) on ``device`` and its per-layer float32 views
    named as vLLM names layers; zero except, with ``block_ids``, the codes of the first ``tokens`` of the
    :data:`TOKENS` prompt tokens in them."""
    heads = rank_heads(rank, tp)
    page = (len(heads), block_size, HEAD_DIM)
    shape = (NUM_BLOCKS, len(layers), *page) if cross_layer else (len(layers), NUM_BLOCKS, *page)
    base = torch.zeros(shape, dtype=torch.int32)
    per_layer = [base[:, i] if cross_layer else base[i] for i in range(len(layers))]
    if block_ids is not None:
        positions = torch.arange(tokens)
        blocks = torch.tensor(block_ids)[positions // block_size]
        slots = positions % block_size
        for i, layer in enumerate(layers):
            for j, head in enumerate(heads):
                rows = torch.tensor([[code(layer, t, head, e) for e in range(HEAD_DIM)] for t in range(tokens)],
                                    dtype=torch.int32)
                per_layer[i][blocks, j, slots] = rows
    base = base.to(device)
    per_layer = [base[:, i] if cross_layer else base[i] for i in range(len(layers))]
    views = {f"model.layers.{layer}.self_attn.attn": view.view(torch.float32)
             for layer, view in zip(layers, per_layer, strict=True)}
    return base, views


def model_info(tp: int, block_size: int, cross_layer: bool = False) -> ModelInfo:
    return ModelInfo(kv_layout="BLHNC" if cross_layer else "LBHNC", attn_layout="HND", dtype="float32",
                     num_kv_heads=HEADS // tp, head_dim=HEAD_DIM, block_size=block_size, total_num_kv_heads=HEADS)


def stage_ranks(pair: Pair, block_ids: list[int], declared_pp: int, only_stages: tuple[int, ...] | None,
                port: int, *, secret: str | None = None) -> list[tuple[WorkerSide, object]]:
    """The prefill workers of ``pair``, ordered by rank (``pp_rank * tp + tp_rank``), each cache holding its
    stage's layers' codes in ``block_ids``; ``declared_pp``: the ``pp_size`` they declare; ``only_stages``: run
    these stages only (the others' ports stay closed: dead stages); ``secret``: secured ranks that stream every
    request layer by layer (else insecure)."""
    out = []
    tp = pair.prefill_tp
    for stage, layers in enumerate(pair.stage_layers()):
        if only_stages is not None and stage not in only_stages:
            continue
        for r in range(tp):
            security = {"secret": secret, "stream_min_tokens": 0} if secret else {"insecure": True}
            config = P2pKvConfig(side_channel_host=HOST, side_channel_port=port, staging_mib=4, **security)
            worker = WorkerSide("prefill", config, r, tp, HOST, port + stage * tp + r, "compat",
                                model_info(tp, pair.block_size), role="prefill", pp_rank=stage, pp_size=declared_pp)
            base, views = make_cache(layers, r, tp, pair.block_size, block_ids=block_ids, device=pair.device)
            worker.register_kv_caches(views, NUM_BLOCKS)
            out.append((worker, (base, views)))
    return out


def ids_for(block_size: int, offset: int) -> list[int]:
    """Block ids for :data:`TOKENS` tokens: a run, then scattered ones."""
    count = -(-TOKENS // block_size)
    run = list(range(offset, offset + count // 2))
    rest = [b for b in range(NUM_BLOCKS - 1, -1, -3) if b not in run]
    return run + rest[: count - len(run)]


@contextlib.contextmanager
def running_prefill(pair: Pair, block_ids: list[int], declared_pp: int | None = None,
                    only_stages: tuple[int, ...] | None = None) -> Iterator[PrefillProc]:
    ranks = pair.prefill_tp * len(pair.stages)
    pf = PrefillProc(free_ports(1, run=ranks)[0],
                     ranks=functools.partial(stage_ranks, pair, block_ids, declared_pp or len(pair.stages),
                                             only_stages))
    pf.start({"req": 120.0})
    try:
        yield pf
    finally:
        pf.stop()


@contextlib.contextmanager
def decode_workers(pair: Pair, pull_thread: bool = True, handshake_attempts: int | None = None,
                   **settings: object) -> Iterator[list[tuple[WorkerSide, torch.Tensor]]]:
    """One decode WorkerSide per decode rank of ``pair`` (``settings``: more :class:`P2pKvConfig` fields; without
    ``pull_thread`` its pulls advance only when stepped; ``handshake_attempts``: each handshake's, see
    :func:`tests.workers.set_handshake_attempts`), shut down on exit."""
    workers: list[tuple[WorkerSide, torch.Tensor]] = []
    port = free_ports(1, run=pair.decode_tp)[0]
    try:
        for r in range(pair.decode_tp):
            config = P2pKvConfig(side_channel_host=HOST, side_channel_port=port, staging_mib=4,
                                 **{"insecure": "secret" not in settings, **settings})
            worker = WorkerSide("decode", config, r, pair.decode_tp, HOST, port + r, "compat",
                                model_info(pair.decode_tp, pair.decode_block_size, pair.cross_layer), role="decode")
            if handshake_attempts is not None:
                set_handshake_attempts(worker, handshake_attempts)
            base, views = make_cache(range(LAYERS), r, pair.decode_tp, pair.decode_block_size, pair.cross_layer,
                                     device=pair.device)
            with mock.patch.object(pull_progress, "INTERVAL_S", pull_progress.INTERVAL_S if pull_thread else 0.0):
                worker.register_kv_caches(views, NUM_BLOCKS)
            workers.append((worker, base))
        yield workers
    finally:
        for worker, _ in workers:
            worker.shutdown()


def load(pair: Pair, prefill: PrefillProc, decoders: list[tuple[WorkerSide, torch.Tensor]], remote_ids: list[int],
         local_ids: list[int], transfer_mode: str, pp_size: int | None = None,
         request: str = "req") -> dict[int, set[int]]:
    """Start the load of prefill request ``request`` (decode request ``d-<request>``) on every decode rank and
    step them until each finished; each rank's load errors."""
    remote = RemotePrefill("prefill", request, HOST, prefill.port, tuple(remote_ids), pair.prefill_tp,
                           transfer_mode=transfer_mode, pp_size=pp_size or len(pair.stages))
    task = LoadSpec(f"d-{request}", tuple(local_ids), tuple(remote_ids), remote, first_token=0, num_tokens=TOKENS)
    for worker, _ in decoders:
        worker.start_load_kv(P2pKvMetadata(loads=[task]))
    errors: dict[int, set[int]] = {}
    deadline = time.monotonic() + 60
    while len(errors) < len(decoders) and time.monotonic() < deadline:
        for rank, (worker, _) in enumerate(decoders):
            if rank not in errors and f"d-{request}" in worker.get_finished()[1]:
                errors[rank] = worker.get_block_ids_with_load_errors()
        time.sleep(0.002)
    assert len(errors) == len(decoders), f"decode ranks {set(range(len(decoders))) - set(errors)} never finished"
    return errors


def wait_released(prefill: PrefillProc, decoders: list[tuple[WorkerSide, torch.Tensor]], ranks: int) -> None:
    end = time.monotonic() + 20
    while len(prefill.released_by_rank) < ranks and time.monotonic() < end:
        for worker, _ in decoders:  # vLLM steps on: each step progresses NIXL's sends
            worker.get_finished()
        prefill.drain(0.02)
    prefill.drain(0.05)


PAIRS = {
    "PP 2 (2+2) -> TP 1, pull": (Pair(), "pull"),
    "PP 2 (2+2) -> TP 1, push": (Pair(), "push"),
    "PP 2 (1+3, uneven) -> TP 1, pull": (Pair(stages=(1, 3)), "pull"),
    "PP 2 x TP 2 -> TP 1 (head slices), pull": (Pair(prefill_tp=2), "pull"),
    "PP 2 x TP 2 -> TP 1 (head slices), push": (Pair(prefill_tp=2), "push"),
    "PP 2 -> TP 2, pull": (Pair(decode_tp=2), "pull"),
    "PP 2 x TP 2 -> TP 2, push": (Pair(prefill_tp=2, decode_tp=2), "push"),
    "PP 2 -> cross-layer decode, pull": (Pair(cross_layer=True), "pull"),
    "PP 3 (1+1+2) -> cross-layer decode, push": (Pair(stages=(1, 1, 2), cross_layer=True), "push"),
    "PP 3 (1+1+2) -> cross-layer decode, pull": (Pair(stages=(1, 1, 2), cross_layer=True), "pull"),
    "PP 2 (1+3) -> cross-layer decode, push": (Pair(stages=(1, 3), cross_layer=True), "push"),
    "PP 2 (block 32) -> TP 1 (block 16), pull: staged": (Pair(block_size=32), "pull"),
    "PP 2 (block 32) -> TP 1 (block 16), push: staged": (Pair(block_size=32), "push"),
    "PP 2 x TP 2 (block 32) -> cross-layer decode (block 16), pull: staged": (
        Pair(prefill_tp=2, block_size=32, cross_layer=True), "pull"),
    "PP 3 (1+1+2, block 16) -> TP 2 (block 32), push: staged": (
        Pair(stages=(1, 1, 2), decode_tp=2, decode_block_size=32), "push"),
}
"""A one-layer stage pairs whole blocks with a cross-layer decode rank's page of that layer, which is not
block-contiguous there: one READ/WRITE row per block (``PP 3``, ``1+3``), where runs of blocks coalesce else."""


@pytest.mark.parametrize("name", list(PAIRS))
def test_each_stage_lands_its_layers_in_the_decode_ranks_matching_layers(name: str) -> None:
    placements = check_pair(*PAIRS[name])
    assert (Placement.STAGED in placements) == name.endswith("staged"), placements


GPU_PAIRS = ["PP 2 (2+2) -> TP 1, pull", "PP 2 x TP 2 -> TP 1 (head slices), push", "PP 2 -> cross-layer decode, pull",
             "PP 2 (block 32) -> TP 1 (block 16), pull: staged"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_PAIRS)
def test_each_stage_lands_its_layers_on_cuda(name: str) -> None:
    """The same with both engines' caches in GPU memory (NIXL VRAM descriptors of a stage's layers)."""
    pair, transfer_mode = PAIRS[name]
    check_pair(dataclasses.replace(pair, device="cuda"), transfer_mode)


def check_pair(pair: Pair, transfer_mode: str) -> set[Placement]:
    """Load request ``req`` from ``pair``'s stages, compare every decode rank's cache with every layer's codes,
    and see every prefill worker release it on notifications; the placements the decode ranks planned."""
    remote_ids, local_ids = ids_for(pair.block_size, 3), ids_for(pair.decode_block_size, 11)
    with running_prefill(pair, remote_ids) as prefill, decode_workers(pair) as decoders:
        errors = load(pair, prefill, decoders, remote_ids, local_ids, transfer_mode)
        assert errors == {r: set() for r in range(pair.decode_tp)}
        for rank, (worker, base) in enumerate(decoders):
            expected, _ = make_cache(range(LAYERS), rank, pair.decode_tp, pair.decode_block_size, pair.cross_layer,
                                     block_ids=local_ids)
            assert torch.equal(base.cpu(), expected), f"decode rank {rank}: blocks differ from every layer's codes"
            stats = worker.take_stats() or {}
            assert stats.get("directions", {}) == {transfer_mode: 1}, stats.get("directions")
            stages = {p.info.pp_rank for p in worker.receiver.peers.peers.values()}
            assert stages == set(range(len(pair.stages)))
        placements = {p.plan.placement for worker, _ in decoders for p in worker.receiver.peers.peers.values()}
        ranks = pair.prefill_tp * len(pair.stages)
        wait_released(prefill, decoders, ranks)
        assert prefill.expired == {}
        assert prefill.released_by_rank == {r: ["req"] for r in range(ranks)}
    return placements


REFUSALS = {  # name: (pair, kv_transfer_params.pp_size (None: the pair's), what the log names)
    "the stages leave a layer out": (Pair(stages=(2, 1)), None, "do not tile the decode engine's 4 layers"),
    "params name pp_size 1 for a staged engine": (Pair(), 1, "pp_size=1, but prefill engine 'prefill' runs "
                                                  "tp_size=1 and pp_size=2"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_pairing_the_stages_cannot_make_fails_the_load_naming_both_sides(name: str, caplog) -> None:
    """Each refusal reports the request's blocks as load errors with a reason naming the values, writes nothing
    into the decode cache, and frees the hold at once on every prefill worker the params name (no lease left to
    expire; params naming one stage of two reach that stage only: the other's hold ends with its lease)."""
    pair, pp_size, why = REFUSALS[name]
    remote_ids, local_ids = ids_for(pair.block_size, 3), ids_for(pair.decode_block_size, 11)
    with running_prefill(pair, remote_ids) as prefill, decode_workers(pair) as decoders:
        errors = load(pair, prefill, decoders, remote_ids, local_ids, "pull", pp_size=pp_size)
        assert errors == {0: set(local_ids)}
        assert why in caplog.text
        assert not decoders[0][1].any(), "a refused load wrote into the decode cache"
        ranks = pair.prefill_tp * (pp_size or len(pair.stages))
        wait_released(prefill, decoders, ranks)
        assert prefill.expired == {}
        assert prefill.released_by_rank == {r: ["req"] for r in range(ranks)}


def test_a_dead_stage_fails_the_load_as_a_dead_rank_does_and_the_live_stage_frees_its_hold(caplog) -> None:
    """Stage 1's workers are gone (nothing listens on their ports): the decode rank's handshake with them fails,
    the load fails with its blocks reported, and stage 0 is told to free the request."""
    pair = Pair()
    remote_ids, local_ids = ids_for(pair.block_size, 3), ids_for(pair.decode_block_size, 11)
    with running_prefill(pair, remote_ids, only_stages=(0,)) as prefill, \
            decode_workers(pair, handshake_timeout_s=1.0, handshake_attempts=1) as decoders:
        errors = load(pair, prefill, decoders, remote_ids, local_ids, "pull")
        assert errors == {0: set(local_ids)}
        assert f"rank 1 at {HOST}:{prefill.port + 1}" in caplog.text
        wait_released(prefill, decoders, 1)
        assert prefill.expired == {}
        assert prefill.released_by_rank == {0: ["req"]}


STREAM_PAIRS = ["PP 2 (2+2) -> TP 1, pull", "PP 2 (1+3, uneven) -> TP 1, pull",
                "PP 2 x TP 2 -> TP 1 (head slices), pull", "PP 2 x TP 2 -> TP 2, push",
                "PP 3 (1+1+2) -> cross-layer decode, pull", "PP 2 (block 32) -> TP 1 (block 16), pull: staged",
                "PP 3 (1+1+2, block 16) -> TP 2 (block 32), push: staged"]
"""Pairs streamed: straight into the decode blocks (whole pages of each stage's layers, a cross-layer decode
block's pages of them) or each stage's heads into their slice of the decode rank's pages (``head_slice``)."""


@pytest.mark.parametrize("name", STREAM_PAIRS)
def test_each_stage_streams_its_layers_into_the_matching_layers_as_it_computes_them(name: str) -> None:
    """Granted streams: every stage's workers take the decode ranks' destinations and WRITE each of their layers
    when vLLM reports it saved (stage 0's forward, then stage 1's, as a pipeline runs them); every decode rank's
    blocks then hold every layer's codes, and every worker of every stage frees its hold."""
    stream_and_check(PAIRS[name][0])


@pytest.mark.parametrize("name", ["PP 2 x TP 2 -> TP 1 (head slices), pull",
                                  "PP 3 (1+1+2, block 16) -> TP 2 (block 32), push: staged"])
def test_a_verified_stream_checks_every_stages_part(name: str) -> None:
    """``verify_kv``: each stage's streamed part (head slices of the decode pages, or whole blocks into staging)
    is checked against the digest of what that stage WROTE."""
    stream_and_check(PAIRS[name][0], verify_kv=True)


def test_a_stage_whose_writes_are_dropped_fails_the_verified_stream_naming_the_models_layer(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Stage 1's WRITEs posted as one byte each (``P2PKV_FAULT_DROP_WRITE`` on its workers only), their digests
    still of what they were to move: the verified stream fails, every block reported, and the mismatch names the
    decode engine's layer: stage 1's first page is the model's layer 2 (layers 2..3 of a 2+2 split), not its
    stage-local 0."""
    monkeypatch.setenv("P2PKV_FAULT_DROP_WRITE", "1")
    monkeypatch.setenv("P2PKV_ALLOW_FAULTS", "1")
    caplog.set_level(logging.WARNING, logger="p2pkv")
    stream_and_check(PAIRS["PP 2 (2+2) -> TP 1, pull"][0], verify_kv=True, dropped_stage=1)
    [line] = [r.getMessage() for r in caplog.records if "KV digest mismatch" in r.getMessage()]
    assert "from prefill rank p2pkv-prefill-tp1-" in line and "differs at layer 2, blocks 11, 12" in line, line


def test_a_grant_signed_for_other_stages_is_refused_by_every_stage_and_nothing_is_written(caplog) -> None:
    """The grant names the prefill engine's stages: one the proxy signed for ``pp_size`` 1 (an incarnation of the
    engine before it ran stages) presented with a leg naming 2 is refused by each stage before any WRITE, naming
    ``pp_size``: the load fails, its blocks reported, and the decode rank's blocks keep their bytes."""
    pair = PAIRS["PP 2 (2+2) -> TP 1, pull"][0]
    remote_ids, local_ids = ids_for(pair.block_size, 3), ids_for(pair.decode_block_size, 11)
    port = free_ports(1, run=len(pair.stages))[0]
    stages = stage_ranks(pair, remote_ids, len(pair.stages), None, port, secret=SECRET)
    deadline = time.monotonic() + 30
    try:
        with decode_workers(pair, secret=SECRET) as decoders:
            granted = granted_stream(remote_ids, TOKENS, port, pair.prefill_tp, pp_size=1)
            remote = dataclasses.replace(granted.remote, pp_size=len(pair.stages))
            load = P2pKvMetadata(loads=[LoadSpec("d-req", tuple(local_ids), (), remote, num_tokens=TOKENS - 1,
                                                 stream_grant=granted.grant)])
            (worker, base), before = decoders[0], decoders[0][1].clone()
            worker.start_load_kv(load)
            while "d-req" not in worker.get_finished()[1]:
                assert time.monotonic() < deadline, "the refused streamed load never finished"
                time.sleep(0.002)
            assert worker.get_block_ids_with_load_errors() == set(local_ids)
            assert "(pp_size 2)" in caplog.text and "another pp_size" in caplog.text
            assert torch.equal(base, before), "a refused stream wrote into the decode rank's blocks"
    finally:
        for worker, _ in stages:
            worker.shutdown()


def staged_bytes(pair: Pair) -> int:
    """Bytes a decode rank's staged stream of ``pair`` moves: every stage's whole prefill blocks holding the
    loaded ``TOKENS - 1`` tokens, of every layer, of the heads it reads (``HEADS / min(TP sizes)``), int32s."""
    blocks = -(-(TOKENS - 1) // pair.block_size)
    heads = HEADS // min(pair.prefill_tp, pair.decode_tp)
    return blocks * LAYERS * heads * pair.block_size * HEAD_DIM * 4


def stream_and_check(pair: Pair, verify_kv: bool = False, dropped_stage: int | None = None) -> None:
    """Stream request ``p-req`` from ``pair``'s stages (all in this process) into every decode rank and compare
    their blocks with every layer's codes; ``verify_kv``: every part checked and verified; ``dropped_stage``: only
    that stage's workers keep the injected faults (a dropped WRITE), so every load fails, found by its check."""
    remote_ids, local_ids = ids_for(pair.block_size, 3), ids_for(pair.decode_block_size, 11)
    port = free_ports(1, run=pair.prefill_tp * len(pair.stages))[0]
    stages = stage_ranks(pair, remote_ids, len(pair.stages), None, port, secret=SECRET)
    for worker, _ in stages:
        if dropped_stage is not None and worker.pp_rank != dropped_stage:
            worker.writes.faults = None
    deadline = time.monotonic() + 30
    try:
        with decode_workers(pair, secret=SECRET, verify_kv=verify_kv) as decoders:
            granted = granted_stream(remote_ids, TOKENS, port, pair.prefill_tp, pp_size=len(pair.stages))
            load = P2pKvMetadata(loads=[LoadSpec("d-req", tuple(local_ids), (), granted.remote,
                                                 num_tokens=TOKENS - 1, stream_grant=granted.grant)])
            for worker, _ in stages:
                worker.start_load_kv(granted.step)
            for worker, _ in decoders:
                worker.start_load_kv(load)
            forward_streamed([(worker, None, views) for worker, (_, views) in stages], granted.step)
            for rank, (worker, base) in enumerate(decoders):
                while "d-req" not in worker.get_finished()[1]:
                    assert time.monotonic() < deadline, f"the streamed load of decode rank {rank} never finished"
                    time.sleep(0.002)
                if dropped_stage is not None:
                    assert worker.get_block_ids_with_load_errors() == set(local_ids)
                    assert "stream:mismatch" in (worker.take_stats() or {}).get("kv_checks", {})
                    continue
                assert worker.get_block_ids_with_load_errors() == set()
                stats = worker.take_stats() or {}
                assert stats.get("directions") == {"stream": 1}
                staged = {p.plan.placement for p in worker.receiver.peers.peers.values()} == {Placement.STAGED}
                assert stats.get("pull_bytes") == [staged_bytes(pair) if staged
                                                   else len(local_ids) * worker.receiver.rank.layout.block_bytes]
                checks = stats.get("kv_checks", {})
                assert set(checks) == ({"stream:verified"} if verify_kv else set()), checks
                expected, _ = make_cache(range(LAYERS), rank, pair.decode_tp, pair.decode_block_size,
                                         pair.cross_layer, block_ids=local_ids,
                                         tokens=TOKENS - 1 if staged else TOKENS)  # staged: the loaded tokens
                assert torch.equal(base, expected), f"decode rank {rank}'s blocks differ from every layer's codes"
            release_prefills([(worker, None, None) for worker, _ in stages], remote_ids, deadline)
    finally:
        for worker, _ in stages:
            worker.shutdown()


def test_a_stage_killed_after_its_handshake_fails_the_load_and_the_live_stage_frees_its_hold(caplog) -> None:
    """Each stage in its own process; a first load lands, so the decode rank knows both stages' agents. Stage 1's
    process is then killed (and reaped) before the second load: that load's READs from stage 0 land, those from
    stage 1's dead agent fail, and the load fails as a pull from any dead rank does (its retry's handshake finds
    nobody), its blocks reported, while stage 0 frees both requests on notifications, none by its lease.

    The kill comes before the READs are posted, not after: a READ over shared memory may complete before a kill
    sent after its post takes effect, and a load whose bytes all landed rightly succeeds."""
    pair = Pair()
    remote_ids, local_ids = ids_for(pair.block_size, 3), ids_for(pair.decode_block_size, 11)
    port = free_ports(1, run=2)[0]
    stages = [PrefillProc(port, ranks=functools.partial(stage_ranks, pair, remote_ids, 2, (stage,)))
              for stage in (0, 1)]
    try:
        for stage in stages:
            stage.start({"req": 120.0, "req-2": 120.0})
        with decode_workers(pair, handshake_timeout_s=1.0, handshake_attempts=1, pull_thread=False) as decoders:
            assert load(pair, stages[0], decoders, remote_ids, local_ids, "pull") == {0: set()}
            stages[1].kill()
            errors = load(pair, stages[0], decoders, remote_ids, local_ids, "pull", request="req-2")
            assert errors == {0: set(local_ids)}
            assert "request=d-req-2" in caplog.text
            end = time.monotonic() + 20
            while stages[0].released_by_rank.get(0, []) != ["req", "req-2"] and time.monotonic() < end:
                decoders[0][0].get_finished()
                stages[0].drain(0.02)
            assert stages[0].released_by_rank == {0: ["req", "req-2"]} and stages[0].expired == {}
    finally:
        stages[0].stop()



@pytest.mark.parametrize("block_size", [16, 32], ids=["head slices", "staged"])
@pytest.mark.parametrize("transfer_mode", ["pull", "push"])
def test_verified_kv_checks_every_stages_part_against_that_stages_digest(transfer_mode: str, block_size: int) -> None:
    """With ``verify_kv``, each stage's part (its layers: head slices of pages, or whole blocks of another size
    into staging) is digested on the stage and where it landed: every part verified, no false mismatch, the same
    bytes as unverified."""
    pair = Pair(prefill_tp=2, block_size=block_size)
    remote_ids, local_ids = ids_for(pair.block_size, 3), ids_for(pair.decode_block_size, 11)
    with running_prefill(pair, remote_ids) as prefill, decode_workers(pair, verify_kv=True) as decoders:
        assert load(pair, prefill, decoders, remote_ids, local_ids, transfer_mode) == {0: set()}
        worker, base = decoders[0]
        expected, _ = make_cache(range(LAYERS), 0, 1, pair.decode_block_size, block_ids=local_ids)
        assert torch.equal(base, expected)
        checks = (worker.take_stats() or {}).get("kv_checks", {})
        assert set(checks) == {f"{transfer_mode}:verified"} and checks[f"{transfer_mode}:verified"] >= 4, checks
