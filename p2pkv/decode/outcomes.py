"""What a decode rank's pulls hand to vLLM at its next engine step: finished requests, failed ones, their blocks."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2pkv.decode.transfer import Transfer


class Outcomes:
    """Ended pulls waiting for vLLM's next ``get_finished``.

    vLLM learns of a finished pull from its request id (finished receiving);
    of a failed one also from its local block ids (load errors, one KV cache
    group) or its request id (failed receiving, several groups). Not
    thread-safe on its own: the receiver calls it under its lock, except
    :meth:`wait`.
    """

    def __init__(self) -> None:
        self.finished: set[str] = set()  # to hand out at the next step
        self._failed: set[str] = set()  # of ``finished``, the failed ones
        self._failed_out: set[str] = set()  # failed ones a step has handed out
        self._load_errors: set[int] = set()
        self._ended = threading.Event()  # set when a pull ends, cleared by take_finished()

    def add(self, request_id: str, block_ids: tuple[int, ...], *, failed: bool, report: bool = True) -> None:
        """One pull ended; ``report``: vLLM waits for it (False: a request that ended before its pull)."""
        if failed:
            self._load_errors.update(block_ids)
        if report:
            self.finished.add(request_id)
            if failed:
                self._failed.add(request_id)
        self._ended.set()

    def report(self, transfer: Transfer) -> None:
        """Hand an ended pull to vLLM: finished receiving, and for a failed one its blocks as load errors (not for
        one given up because its request ended: nobody reads them)."""
        self.add(transfer.request_id, transfer.spec.local_block_ids, failed=transfer.failed and not transfer.given_up,
                 report=transfer.spec.report)

    def take_finished(self) -> set[str]:
        """Request ids ended since the last call (loaded or failed)."""
        finished, self.finished = self.finished, set()
        self._ended.clear()
        self._failed_out |= self._failed & finished
        self._failed -= finished
        return finished

    def take_failed(self) -> set[str]:
        """Request ids among those :meth:`take_finished` handed out since the last call whose pull failed."""
        failed, self._failed_out = self._failed_out, set()
        return failed

    def take_load_errors(self) -> set[int]:
        """Local block ids of failed pulls since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for a pull to end; True when one did."""
        return self._ended.wait(timeout_s)
