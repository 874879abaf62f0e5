"""A pull's last phase: the fence's verdicts acted on, and a pull whose parts are all confirmed recorded and done.

After its READs (``FENCING``, :class:`p2pkv.decode.transfer.TransferState`),
a pull waits for each prefill rank it READ from to confirm that it still
held the blocks while they were read (:mod:`p2pkv.decode.fence`). A verdict
``FAIL`` ends the pull as the answer says (its blocks load errors, its
parts drained first); once every part is ``CONFIRMED`` the pull is counted
in the stats (and the ``stats_file``), its prefill ranks are queued to be
notified (:class:`p2pkv.decode.notifier.Notifier`) and it is ``DONE``. With
``verify_kv``, here too every part's digest is checked against its prefill
rank's before ``DONE`` (:mod:`p2pkv.decode.verify`): every way that lands
rows passes this one gate.
"""

from __future__ import annotations

import time

from handshake import KVLayoutDesc
from p2pkv.decode.drain import Drain
from p2pkv.decode.endings import Endings
from p2pkv.decode.failures import FailureKind
from p2pkv.decode.fence import Hold, Verdict, failure_of
from p2pkv.decode.notifier import Notifier
from p2pkv.decode.transfer import Part, Transfer, TransferState
from p2pkv.decode.verify import Check, findings, judge
from p2pkv.telemetry.stats import StatsBuffer, append_json_line


class Confirmations:
    """Acts on fence verdicts and finishes confirmed pulls (the receiver's lock held by every caller).

    Args:
        drain: where a failed pull's parts wait out what may still land.
        endings: sets pulls' states and fails them.
        notifier: queues the "done" notifications to the prefill ranks of a finished pull.
        stats: the worker's statistics.
        stats_file: JSON-lines file each finished pull is appended to ("": none).
        desc: this rank's KV layout (where a verified part's bytes differ, in its log line).
    """

    def __init__(self, drain: Drain, endings: Endings, notifier: Notifier, stats: StatsBuffer,
                 stats_file: str, desc: KVLayoutDesc) -> None:
        self.desc = desc
        self.drain = drain
        self.endings = endings
        self.notifier = notifier
        self.stats = stats
        self.stats_file = stats_file

    def judged(self, read: Part, verdict: Verdict, answer: Hold | Exception) -> None:
        """Act on the verdict on one fence answer about ``read`` (:meth:`p2pkv.decode.fence.Fence.verdicts`)."""
        if verdict is Verdict.FAIL:
            self.drain.abandon(read.transfer)
            transfer = read.transfer
            self.endings.fail(transfer, *failure_of(answer, transfer.spec.remote.request_id, transfer.questions))
        elif verdict is Verdict.CONFIRMED:
            read.confirmed = True
            self.if_done(read.transfer)

    def if_done(self, transfer: Transfer) -> None:
        """``FENCING`` with every part confirmed (and, verified, every part's digest equal to its prefill rank's:
        :mod:`p2pkv.decode.verify`): the pull is done (recorded, prefill ranks to notify). A part whose digest
        differs or never came fails it (``digest_mismatch``: its blocks load errors)."""
        if transfer.state is TransferState.FENCING and all(r.confirmed for r in transfer.parts):
            if transfer.verify and not self._verified(transfer):
                return
            transfer.marks["confirmed"] = time.time()
            record(transfer, self.stats, self.stats_file)
            self.notifier.add(transfer)
            self.endings.to(transfer, TransferState.DONE)


    def _verified(self, transfer: Transfer) -> bool:
        """Every part of ``transfer`` verified (True); else False, and a part that failed its check fails it
        (logged naming request, prefill rank, where the bytes differ and both digests; counted by direction and
        outcome)."""
        failed, decided = findings(transfer)
        if not decided and not failed:
            return False  # a digest still to come: the fence's answer, or the push's word, brings it
        direction = transfer.direction().value
        for part in transfer.parts:
            check = judge(part)
            if check is not Check.WAIT:
                self.stats.record_check(direction, check.value)
        if not failed:
            return True
        self.drain.abandon(transfer)
        self.endings.fail(transfer, FailureKind.DIGEST_MISMATCH, failed[0].describe(self.desc))
        return False


def record(transfer: Transfer, stats: StatsBuffer, stats_file: str) -> None:
    """Count a finished pull (all its READs) in the stats and, if configured, the stats file (one JSON line:
    ids, peers, blocks, bytes, descriptors, seconds from the first READ posted to the last seen done, direction,
    phase marks, fence questions)."""
    spec, seconds = transfer.spec, max(r.done for r in transfer.parts) - transfer.started
    direction = transfer.direction().value
    stats.record_pull(transfer.num_bytes, seconds, transfer.num_descriptors, direction)
    stats.record_phases(transfer.marks)
    if stats_file:
        append_json_line(stats_file, {
            "request_id": spec.request_id, "remote_request_id": spec.remote.request_id,
            "peer": ",".join(r.peer.agent_name for r in transfer.parts), "blocks": len(spec.local_block_ids),
            "bytes": transfer.num_bytes, "descriptors": transfer.num_descriptors, "seconds": seconds,
            "direction": direction,
            "marks": transfer.marks, "fence": transfer.questions})
