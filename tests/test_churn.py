"""Churn: over a thousand pulls through real WorkerSides and NIXL agents, with aborts, injected
faults and a prefill process killed and restarted mid-run.

One prefill :class:`~p2pkv.worker.WorkerSide` runs in its own process
(:class:`tests.p2p_harness.PrefillProc`), the decode ``WorkerSide`` here.
Requests go in batches of :data:`BATCH` tasks per ``start_load_kv``, with
random block ids (distinct local ids within a batch, as the allocator gives
in-flight requests), about :data:`ABORT_RATE` of them notify-only tasks with
``report=False`` (what the scheduler sends for an aborted request). Every few
batches one NIXL call of the decode agent fails once (:mod:`tests.faults`).
Twice in the run the prefill process is SIGKILLed while a batch is in
flight and a new one (same port, same engine_id, other cache contents) takes
over the leases the old one had not released: after the first restart the
decode side re-handshakes and its retries succeed; the second new process
starts only after the decode side gave up on the dead one (its handshake
window closed), so that batch's pulls fail as load errors and the new
process releases their leases on expiry.

Checked at the end:

* decode: every pull finished receiving exactly once (none hung), and either
  all its local blocks hold exactly the prefill bytes (every completion is
  compared) or all of them, and no other block, are load errors; aborted
  requests are never reported;
* prefill: every leased request was released exactly once over both
  incarnations (by notification or lease expiry), and none is held at the
  end, so no block leaks.

The same churn runs in push mode (``transfer_mode: push``: the prefill rank
WRITEs each request's blocks when the decode worker asks), with the faults
injected into the prefill process's NIXL agent instead (its WRITEs fail to
start or fail while in flight: the decode worker re-handshakes and asks once
more), and every hold must also end unpinned (no WRITE left queued or in
flight). Both restarts happen there too. A killed prefill process answers no
push request; the first one that goes unanswered makes the decode worker
retry the others still queued for that process at once, after a new
handshake (they used to wait out one reply timeout each on the prefill
rank's lane, so the batch's last pulls timed out "still in flight" with
their requests never sent: ``tests/test_push_lane.py``). So a kill batch's pulls move the new
incarnation's bytes, or fail as load errors when the new process came up
after the handshake window, or, for a push the dead process had accepted,
after ``transfer_timeout_s``.

``P2PKV_CHURN_PULLS`` (default 1000; push mode: ``P2PKV_CHURN_PUSH_PULLS``,
default 400) and ``P2PKV_CHURN_SEED`` change the run; the counts are printed
as one ``CHURN`` JSON line (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from tests.faults import FaultyNixlAgent, inject, restore
from tests.p2p_harness import DecodeSide, PrefillProc, free_port, notify_task, pull_task

NUM_BLOCKS = 256
BATCH = 50
ABORT_RATE = 0.1
MAX_BLOCKS_PER_REQUEST = 4  # 50 x 4 <= 256: a batch's local ids never repeat
LEASE_S = 6.0
HANDSHAKE_TIMEOUT_S, HANDSHAKE_ATTEMPTS = 1.0, 2
BATCH_TIMEOUT_S = 30.0
FAULT_EVERY = 3  # batches
FAULTS = [
    ("get_xfer_descs", "raise"), ("initialize_xfer", "raise"), ("transfer", "raise"), ("transfer", "err"),
    ("check_xfer_state", "raise"), ("check_xfer_state", "err"), ("release_xfer_handle", "raise"),
]
"""NIXL calls of a READ (pull mode: the decode agent's) or of a WRITE (push mode: the prefill agent's)."""


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_churn_pulls_aborts_faults_and_prefill_restarts(mode: str) -> None:
    t_start = time.monotonic()
    push = mode == "push"
    n_pulls = int(os.environ.get("P2PKV_CHURN_PUSH_PULLS" if push else "P2PKV_CHURN_PULLS", "400" if push else "1000"))
    seed = int(os.environ.get("P2PKV_CHURN_SEED", "20261123"))
    rng = random.Random(seed)
    pf = PrefillProc(free_port(), seed=1, num_blocks=NUM_BLOCKS, lease_s=LEASE_S)
    pf.start()
    d = DecodeSide(NUM_BLOCKS, handshake_timeout_s=HANDSHAKE_TIMEOUT_S, handshake_attempts=HANDSHAKE_ATTEMPTS,
                   transfer_timeout_s=10.0, transfer_mode=mode, verify_kv=True)  # no false mismatch under churn
    counts = dict(pulls=0, aborts=0, completed=0, verified_blocks=0, failed=0, failed_blocks=0, hung=0,
                  reported_twice=0, restarts=0, faults_injected=0, faults_fired=0, failed_in_kill_batches=0,
                  failed_in_fault_batches=0, in_flight_at_kills=[], leases_moved_to_restarts=[],
                  restart_seconds=[], failed_by_batch={}, kill_batches=[], fault_batches=[])
    blocks_of: dict[str, int] = {}  # prefill request id -> blocks it holds
    batch_no = 0
    n_batches = -(-n_pulls // round(BATCH * (1 - ABORT_RATE)))
    kill_batches = [n_batches // 3 + 1, 2 * n_batches // 3 + 1]  # not fault batches (every FAULT_EVERY-th)
    counts["kill_batches"] = kill_batches
    try:
        while counts["pulls"] < n_pulls:
            batch_no += 1
            seeds = {pf.seed}
            d.base.zero_()  # a block not written by its pull cannot pass for one that was
            tasks, pulls = [], {}
            n_abort = sum(rng.random() < ABORT_RATE for _ in range(BATCH))
            sizes = [rng.randint(1, MAX_BLOCKS_PER_REQUEST) for _ in range(min(BATCH - n_abort,
                                                                               n_pulls - counts["pulls"]))]
            local_ids = rng.sample(range(NUM_BLOCKS), sum(sizes))
            remote_ids = rng.sample(range(NUM_BLOCKS), sum(sizes))
            at = 0
            for k in sizes:
                n = counts["pulls"] + len(pulls)
                rid, prid = f"d-{n}", f"p-{n}"
                local, remote = local_ids[at:at + k], remote_ids[at:at + k]
                at += k
                tasks.append(pull_task(rid, prid, pf.port, local, remote))
                pulls[rid] = (prid, local, remote)
                blocks_of[prid] = k
            for i in range(n_abort):
                prid = f"a-{counts['aborts'] + i}"
                tasks.append(notify_task(f"d-{prid}", prid, pf.port))
                blocks_of[prid] = rng.randint(1, MAX_BLOCKS_PER_REQUEST)
            rng.shuffle(tasks)
            pf.lease([t.remote.request_id for t in tasks])
            counts["pulls"] += len(pulls)
            counts["aborts"] += n_abort

            faulty: FaultyNixlAgent | None = None
            faulted = batch_no % FAULT_EVERY == 0 and batch_no not in kill_batches
            if faulted:
                method, how = rng.choice(FAULTS)
                if push:
                    pf.inject((method, rng.randint(1, 20), how, 1))
                else:
                    faulty = inject(d.worker, method, rng.randint(1, 20), how)  # type: ignore[arg-type]
                counts["faults_injected"] += 1
                counts["fault_batches"].append(batch_no)

            d.start(*tasks)
            if batch_no in kill_batches:
                # Kill the prefill process with the batch's READs posted (they progress only when
                # polled); a new incarnation (other bytes) takes over every lease the old one had
                # not released. First restart: decode steps again only once it serves, so the
                # re-handshake finds it and the retries succeed. Second: the new process starts
                # only after decode gave up on the dead one (handshake window closed), so the
                # batch's pulls fail.
                quick = batch_no == kill_batches[0]
                counts["in_flight_at_kills"].append(len(d.worker.receiver.transfers))
                pf.kill()
                t_kill = time.monotonic()
                if not quick:
                    missing = d.pump(set(pulls), BATCH_TIMEOUT_S)
                    assert not missing, f"pulls from a dead prefill hung: {sorted(missing)[:10]}"
                remaining = pf.unreleased()
                counts["leases_moved_to_restarts"].append(len(remaining))
                pf.start({r: LEASE_S for r in remaining}, seed=pf.seed + 1)
                counts["restarts"] += 1
                seeds.add(pf.seed)
                counts["restart_seconds"].append(round(time.monotonic() - t_kill, 1))
            missing = d.pump(set(pulls), BATCH_TIMEOUT_S)
            d.pump(set(), 0.02)
            if faulty is not None:
                counts["faults_fired"] += faulty.faults
                restore(d.worker)
            elif faulted:
                counts["faults_fired"] += pf.restore()["faults"]
            counts["hung"] += len(missing)

            errors = d.take_errors()
            stray = errors - {b for _, local, _ in pulls.values() for b in local}
            assert not stray, f"batch {batch_no}: load errors for blocks of no pull in it: {sorted(stray)}"
            expected = {s: pf.expected(s) for s in seeds}
            for rid, (_, local, remote) in pulls.items():
                if rid in missing:
                    continue
                counts["reported_twice"] += d.finished[rid] > 1
                if set(local) <= errors:
                    counts["failed"] += 1
                    counts["failed_blocks"] += len(local)
                    counts["failed_in_kill_batches"] += batch_no in kill_batches
                    counts["failed_in_fault_batches"] += faulted
                    counts["failed_by_batch"][batch_no] = counts["failed_by_batch"].get(batch_no, 0) + 1
                    continue
                assert not set(local) & errors, f"{rid}: only some of its blocks are load errors"
                assert any(all(d.block_ok(lb, rb, expected[s]) for lb, rb in zip(local, remote, strict=True))
                           for s in seeds), f"{rid} reported done but its blocks do not hold the prefill bytes"
                counts["completed"] += 1
                counts["verified_blocks"] += len(local)
            assert not any(t.request_id in d.finished for t in tasks if not t.report), "abort reported"
            for rid in pulls:
                d.finished.pop(rid, None)
            pf.drain()

        # Every lease ends: by notification, or expiry for the pulls that failed. The decode worker keeps
        # stepping, as an engine does (its steps progress NIXL's sends of the last "done" notifications).
        end = time.monotonic() + LEASE_S + 10
        while pf.unreleased() and time.monotonic() < end:
            d.step()
            pf.drain(0.01)
        all_released = not pf.unreleased()
        held = pf.stop()
        checks = dict(d.worker.stats.data["kv_checks"])  # verified KV: every landed part's check
    finally:
        d.close()
        pf.stop()

    twice = sorted(r for r in pf.leased if pf.times_released(r) > 1)
    never = sorted(pf.unreleased())
    counts.update(
        requests=counts["pulls"] + counts["aborts"], batches=batch_no,
        prefill_released_by_notification=sum(pf.notified.values()),
        prefill_released_by_expiry=sum(pf.expired.values()),
        prefill_released_twice=len(twice), prefill_never_released=len(never), prefill_held_at_end=len(held),
        prefill_pinned_at_end=sum((pf.pinned_at_stop or {}).values()), mode=mode,
        blocks_leaked=sum(blocks_of.get(r, 0) for r in set(held) | set(never)),
        seconds=round(time.monotonic() - t_start, 1), seed=seed, kv_checks=checks,
    )
    print("CHURN " + json.dumps(counts, sort_keys=True))
    assert counts["hung"] == 0, counts
    assert counts["reported_twice"] == 0, counts
    assert counts["completed"] + counts["failed"] == counts["pulls"] >= n_pulls, counts
    assert counts["restarts"] == 2 and counts["faults_fired"] >= 1, counts
    assert counts["prefill_pinned_at_end"] == 0, counts
    assert not twice, f"released more than once on the prefill side: {twice[:20]}"
    assert all_released and not never, f"leased but never released: {never[:20]}"
    assert held == [] and counts["blocks_leaked"] == 0, counts
    # Failures only where a fault or the restart explains them.
    assert counts["failed"] == counts["failed_in_kill_batches"] + counts["failed_in_fault_batches"], counts
    # Every pull handed over was verified; a check failed only where a fault or a restart explains it: it caught
    # the fault, or the prefill's next incarnation could not vouch for bytes READ from the one killed (fail closed).
    assert checks.get(f"{mode}:verified", 0) == counts["completed"], counts
    explained = counts["failed_in_fault_batches"] + counts["failed_in_kill_batches"]
    assert checks.get(f"{mode}:mismatch", 0) + checks.get(f"{mode}:missing", 0) <= explained, counts
