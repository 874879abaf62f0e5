"""A side-channel call that ends while the decode worker gathers answers is answered exactly once.

The calls run on lane threads; the worker thread splits its pending calls
into answered and still pending. Asking each future twice (once per list)
lost a call that ended in between: it was in neither list. A push request's
refusal lost that way (the first push to a restarted prefill engine is
refused: its rows were planned on the old incarnation) was neither retried
nor failed, and its pull timed out "still in flight" after
``transfer_timeout_s`` (``tests/test_churn.py``'s push run, 1 pull in 400,
under load).
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from handshake import PROTOCOL_VERSION, PushReply
from p2pkv.decode.background import take_done
from p2pkv.decode.pushes import Pushes


class EndsWhenAsked(Future):
    """A call that ends right after the first time anyone asks whether it has (a lane thread finishing it)."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self._pending_result = result
        self.asked = 0

    def done(self) -> bool:
        self.asked += 1
        was = super().done()
        if not was:
            self.set_result(self._pending_result)
        return was


def test_take_done_asks_each_future_once_so_a_call_ending_meanwhile_stays_pending() -> None:
    ended, ending, running = Future(), EndsWhenAsked("late"), Future()
    ended.set_result("early")
    done, rest = take_done([(ended, "a"), (ending, "b"), (running, "c")])
    assert [x for _, x in done] == ["a"] and [x for _, x in rest] == ["b", "c"]
    assert ending.asked == 1
    done, rest = take_done(rest)  # the next pass answers it
    assert [x for _, x in done] == ["b"] and [x for _, x in rest] == ["c"]


def test_a_push_refusal_that_arrives_while_replies_are_gathered_is_returned_on_the_next_pass() -> None:
    pushes = Pushes.__new__(Pushes)  # only the reply bookkeeping is exercised here
    part = SimpleNamespace(push_id=b"p" * 16, peer=object())
    refused = PushReply(protocol_version=PROTOCOL_VERSION, status="refused", message="source_rows: stale")
    pushes._open = {part.push_id: part}
    pushes._replies = [(EndsWhenAsked(refused), part)]
    assert pushes.replies() == []  # it ended while this pass looked: still pending, not dropped
    assert pushes.replies() == [(part, refused)]
    assert pushes.ended(part)  # a refused request wrote nothing: no longer open
    assert pushes.replies() == []
