"""Notifications sorted by prefix for the readers that share one NIXL agent (no NIXL: a scripted fetch)."""

from __future__ import annotations

from p2pkv.dataplane.inboxes import Inboxes


def test_each_reader_takes_its_prefix_and_nothing_is_lost_or_taken_twice() -> None:
    arrivals = [{"a": [b"p2pkv:push:1", b"p2pkv:done:x"]}, {"b": [b"p2pkv:push:2"], "c": [b"other"]}, {}]
    inboxes = Inboxes(lambda: arrivals.pop(0) if arrivals else {})
    assert inboxes.take(b"") == [b"p2pkv:push:1", b"p2pkv:done:x"]  # no prefix known yet: all to the rest
    assert inboxes.take(b"p2pkv:push:") == [b"p2pkv:push:2"]  # known from now on
    inboxes.progress()  # fetches (the third arrival: nothing) and takes nothing
    arrivals.append({"a": [b"p2pkv:done:y", b"p2pkv:push:3"]})
    inboxes.progress()
    assert inboxes.take(b"p2pkv:push:") == [b"p2pkv:push:3"]
    assert inboxes.take(b"") == [b"other", b"p2pkv:done:y"]
    assert inboxes.take(b"") == [] and inboxes.take(b"p2pkv:push:") == []
