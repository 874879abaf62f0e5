"""Churn in stream mode: batches of layer streams through a real prefill WorkerSide (its own process) and a real
decode WorkerSide (here), with decode aborts, prefill aborts, destinations early and late, NIXL faults on the
prefill's WRITEs and a prefill process killed mid-batch and restarted.

Each stream's prompt is 2–4 blocks, prefilled in two steps (chunked prefill:
its first block, then the rest), every layer reported done in each step as
vLLM reports it. Per batch of :data:`BATCH` streams, each one at random:

* its decode rank's destination comes before the prefill's first step or
  after it (then the layers already computed go at once);
* about :data:`ABORT_RATE` are decode requests aborted between the two steps
  (named in ``ended_streams``: the stream is given up);
* about :data:`ABORT_RATE` are prefill requests aborted between the steps
  (``stream_aborts``);
* about :data:`ABORT_RATE` are prefill requests preempted between the steps
  (half of them told in ``stream_restarts``, the others seen when they come
  back) and computed again whole into other blocks, whose bytes must be the
  ones that land;
* every :data:`FAULT_EVERY`-th batch, one NIXL call of the prefill rank's
  WRITEs fails once;
* in one batch the prefill process is SIGKILLed between the steps, and a new
  incarnation (other cache values) serves the next batches.

Checked: every decode load ends exactly once (none hangs); a load given up
is reported with no load errors; every other one either holds exactly the
prefill's bytes in all its blocks, or has all of them, and no other block,
as load errors — and failures happen only to prefill-aborted requests or in
the fault and kill batches; every prefill hold made is released, and none
is held at the end.

``P2PKV_CHURN_STREAMS`` (default 120) and ``P2PKV_CHURN_SEED`` change the
run; the counts are printed as one ``CHURN_STREAM`` JSON line (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import random
import time

import torch

from p2pkv.grant import ANY_DECODE, check_stream_grant, make_stream_grant
from p2pkv.metadata import LoadSpec, P2pKvMetadata, StreamChunk
from p2pkv.params import RemotePrefill
from p2pkv.prompt_digest import prompt_digest
from tests.p2p_harness import ENGINE, DecodeSide, PrefillProc, free_port, shape

SECRET = "stream-churn-test-secret-32bytes"
NUM_BLOCKS = 128
BLOCK_SIZE = shape(NUM_BLOCKS)["block_size"]
LAYERS = [f"layers.{i}" for i in range(shape(NUM_BLOCKS)["num_layers"])]
BATCH = 12
ABORT_RATE = 0.1
FAULT_EVERY = 3
FAULTS = [("get_xfer_descs", "raise"), ("initialize_xfer", "raise"), ("transfer", "raise"), ("transfer", "err"),
          ("check_xfer_state", "raise"), ("check_xfer_state", "err")]
WINDOW_S = 4.0  # the decode rank's transfer_timeout_s: a stream from a killed prefill fails after it
BATCH_TIMEOUT_S = 30.0


def _make(rng: random.Random, n: int, port: int, source: list[int], target: list[int]
          ) -> tuple[StreamChunk, StreamChunk, LoadSpec]:
    """Stream ``n``: its two prefill chunks (first block, then the rest) and its decode rank's load."""
    grant = make_stream_grant(ENGINE, ANY_DECODE, SECRET.encode(), time.time() + 100)  # within 4 x lease_s (30 s)
    stream_id = check_stream_grant(grant, SECRET.encode(), prefill_engine_id=ENGINE,
                                   decode_engine_id="decode-engine", now=time.time()).stream_id
    prompt = len(source) * BLOCK_SIZE
    loaded = prompt - 1  # the decode engine computes the last token itself
    digest = prompt_digest([rng.randrange(1000)] * loaded)
    first = StreamChunk(f"p-{n}", stream_id, 0, tuple(source[:1]), BLOCK_SIZE, False, digest, loaded)
    rest = StreamChunk(f"p-{n}", stream_id, 1, tuple(source[1:]), prompt, True)
    remote = RemotePrefill(ENGINE, stream_id, "127.0.0.1", port, (), 1, num_tokens=loaded, prompt_digest=digest,
                           transfer_mode="stream")
    return first, rest, LoadSpec(f"d-{n}", tuple(target), (), remote, num_tokens=loaded, stream_grant=grant)


def test_streams_under_aborts_faults_late_destinations_and_a_prefill_restart() -> None:
    t_start = time.monotonic()
    n_streams = int(os.environ.get("P2PKV_CHURN_STREAMS", "120"))
    seed = int(os.environ.get("P2PKV_CHURN_SEED", "20261127"))
    rng = random.Random(seed)
    pf = PrefillProc(free_port(), seed=1, num_blocks=NUM_BLOCKS, lease_s=30.0,
                     settings={"secret": SECRET, "stream_min_tokens": 0})
    pf.start()
    d = DecodeSide(NUM_BLOCKS, secret=SECRET, transfer_timeout_s=WINDOW_S, handshake_timeout_s=1.0,
                   handshake_attempts=1, verify_kv=True)  # no false mismatch under churn and preemption
    n_batches = -(-n_streams // BATCH)
    kill_batch = next(b for b in range(n_batches // 2 + 1, n_batches + 1) if b % FAULT_EVERY)
    counts: dict = dict(streams=0, completed=0, given_up=0, prefill_aborted=0, failed=0, late_destinations=0,
                        failed_in_fault_batches=0, failed_in_kill_batch=0, faults_fired=0, hung=0,
                        reported_twice=0, restarts=0, preempted=0, failed_by_batch={})
    try:
        for batch_no in range(1, n_batches + 1):
            d.base.zero_()
            size = min(BATCH, n_streams - counts["streams"])
            sizes = [rng.randint(2, 4) for _ in range(size)]
            pool = rng.sample(range(NUM_BLOCKS), 2 * sum(sizes))  # a preempted request's second blocks: the rest
            sources, spare = pool[:sum(sizes)], pool[sum(sizes):]
            targets = rng.sample(range(NUM_BLOCKS), sum(sizes))
            streams, at = [], 0
            for k in sizes:
                n = counts["streams"] + len(streams)
                streams.append(_make(rng, n, pf.port, sources[at:at + k], targets[at:at + k]))
                at += k
            counts["streams"] += size
            late = {s[2].request_id for s in streams if rng.random() < 0.5}
            counts["late_destinations"] += len(late)
            given_up = {s[2].request_id for s in streams if rng.random() < ABORT_RATE}
            prefill_aborted = {s[0].request_id for s in streams if s[2].request_id not in given_up
                               and rng.random() < ABORT_RATE and batch_no != kill_batch}
            preempted = {s[0].request_id for s in streams if s[2].request_id not in given_up
                         and s[0].request_id not in prefill_aborted and rng.random() < ABORT_RATE
                         and batch_no != kill_batch}
            told = sorted(r for r in preempted if rng.random() < 0.5)
            resumed = {}  # prefill request id → its chunk when it comes back: every block again, in other blocks
            for first, rest, _ in streams:
                if first.request_id in preempted:
                    blocks = tuple(spare[:len(first.block_ids) + len(rest.block_ids)])
                    spare = spare[len(blocks):]
                    resumed[first.request_id] = StreamChunk(first.request_id, first.stream_id, 0, blocks,
                                                            rest.num_tokens, True, first.prompt_digest,
                                                            first.loaded_tokens)
            counts["preempted"] += len(preempted)
            faulted = batch_no % FAULT_EVERY == 0
            if faulted:
                method, how = rng.choice(FAULTS)
                pf.inject((method, rng.randint(1, 2 * size), how, 1))

            d.start(*[s[2] for s in streams if s[2].request_id not in late])
            pf.call("stream", [s[0] for s in streams], LAYERS, True)
            d.start(*[s[2] for s in streams if s[2].request_id in late])
            d.pump(set(), 0.05)
            d.worker.start_load_kv(P2pKvMetadata(ended_streams=sorted(given_up)))
            if batch_no == kill_batch:
                pf.kill()
                missing = d.pump({s[2].request_id for s in streams}, BATCH_TIMEOUT_S)
                assert not missing, f"streams from a dead prefill hung: {sorted(missing)}"
                pf.start({}, seed=pf.seed + 1)
                counts["restarts"] += 1
            else:
                if preempted:  # a step that runs none of them: vLLM freed their blocks
                    pf.call("stream", [], LAYERS, True, None, told)
                rest = [resumed.get(s[1].request_id, s[1]) for s in streams if s[1].request_id not in prefill_aborted]
                pf.call("stream", rest, LAYERS, True, {r: "the prefill request was aborted" for r in prefill_aborted})
                ids = [s[0].request_id for s in streams]
                pf.lease(ids)  # each prefill request finished: its hold made (the stream frees it when it ends)
            missing = d.pump({s[2].request_id for s in streams}, BATCH_TIMEOUT_S)
            counts["hung"] += len(missing)
            if faulted:
                counts["faults_fired"] += pf.restore()["faults"]

            errors = d.take_errors()
            expected = pf.expected()
            for first, _, load in streams:
                rid, target = load.request_id, set(load.local_block_ids)
                if rid in missing:
                    continue
                counts["reported_twice"] += d.finished[rid] > 1
                if rid in given_up:
                    assert not target & errors, f"{rid}: a given-up stream's blocks reported as load errors"
                    counts["given_up"] += 1
                    continue
                if target <= errors:
                    counts["failed"] += 1
                    counts["prefill_aborted"] += first.request_id in prefill_aborted
                    counts["failed_in_fault_batches"] += faulted and first.request_id not in prefill_aborted
                    counts["failed_in_kill_batch"] += batch_no == kill_batch
                    counts["failed_by_batch"][batch_no] = counts["failed_by_batch"].get(batch_no, 0) + 1
                    continue
                assert not target & errors, f"{rid}: only some of its blocks are load errors"
                assert first.request_id not in prefill_aborted, f"{rid}: an aborted prefill's stream landed"
                source = list(resumed[first.request_id].block_ids) if first.request_id in resumed else [
                    *first.block_ids, *next(s[1] for s in streams if s[2] is load).block_ids]
                assert torch.equal(d.base[list(load.local_block_ids)], expected[source]), \
                    f"{rid} reported done but its blocks do not hold the prefill's bytes"
                counts["completed"] += 1
            stray = errors - {b for _, _, load in streams for b in load.local_block_ids}
            assert not stray, f"batch {batch_no}: load errors for blocks of no stream in it: {sorted(stray)}"
            for _, _, load in streams:
                d.finished.pop(load.request_id, None)
            end = time.monotonic() + 10  # every hold ends once its stream has (the decode rank steps meanwhile)
            while pf.unreleased() and time.monotonic() < end:
                d.step()
                pf.drain(0.01)
            assert not pf.unreleased(), f"batch {batch_no}: holds never released: {sorted(pf.unreleased())[:10]}"
        held = pf.stop()
        checks = dict(d.worker.stats.data.get("kv_checks", {}))  # verified KV: every landed stream's check
    finally:
        d.close()
        pf.stop()
    counts.update(seconds=round(time.monotonic() - t_start, 1), seed=seed, kill_batch=kill_batch,
                  held_at_end=len(held), kv_checks=checks)
    print("CHURN_STREAM " + json.dumps(counts, sort_keys=True))
    assert counts["hung"] == 0 and counts["reported_twice"] == 0, counts
    assert counts["completed"] + counts["failed"] + counts["given_up"] == counts["streams"] >= n_streams, counts
    assert counts["restarts"] == 1 and counts["faults_fired"] >= 1 and counts["preempted"] >= 1, counts
    assert counts["completed"] > counts["streams"] // 2, counts
    assert counts["failed"] == (counts["prefill_aborted"] + counts["failed_in_fault_batches"]
                                + counts["failed_in_kill_batch"]), counts
    assert held == [], f"held at the end: {held[:10]}"
    # Every stream handed over was verified, preempted ones computed again included; a check failed only where a
    # fault or the kill explains it.
    assert checks.get("stream:verified", 0) == counts["completed"], counts
    explained = counts["failed_in_fault_batches"] + counts["failed_in_kill_batch"]
    assert checks.get("stream:mismatch", 0) + checks.get("stream:missing", 0) <= explained, counts
