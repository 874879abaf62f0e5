"""The ways KV moves from a prefill engine to a decode engine, in one registry: what each way is, on both sides.

There are three (:data:`WAYS`): ``pull`` (the decode rank READs the prefill
rank's blocks, fenced by hold questions), ``push`` (the prefill rank WRITEs
the rows a :class:`handshake.PushRequest` names, after the prefill) and
``stream`` (the prefill rank WRITEs each layer as its forward computes it,
into the blocks a :class:`handshake.StreamRequest` names; the decode leg
carries a signed stream grant, :mod:`p2pkv.grant`). Each :class:`Way` names

- the side-channel requests the decode rank sends for it (``requests``), and
  the keyword of :class:`handshake.HandshakeServer` by which the prefill
  worker (:mod:`p2pkv.worker`) passes the handler that answers them
  (``handler``);
- its decode mover, a class of :mod:`p2pkv.decode.movers` (``mover``;
  :func:`p2pkv.decode.movers.movers` builds one of each);
- what the decode lifecycle (:mod:`p2pkv.decode.receiver`,
  :mod:`p2pkv.decode.deadlines`, :mod:`p2pkv.decode.pushes`, ...) asks of a
  way instead of asking which way a transfer moves: its traits.

:class:`p2pkv.decode.direction.Direction` has one value per way (its name);
``tests/test_ways.py`` keeps the registry, ``Direction``, ``movers()`` and the
side-channel server's handler table equal.

What a fourth way touches now: its :class:`Way` here (requests, handler,
mover, traits); a ``Direction`` value (:mod:`p2pkv.decode.direction`, and
when :class:`~p2pkv.decode.direction.Directions` picks it); its
:class:`~p2pkv.decode.movers.Mover` and its entry in ``movers()``
(:mod:`p2pkv.decode.movers`, with its own planning, :meth:`Mover.plan
<p2pkv.decode.movers.Mover.plan>`, where its parts are not rows); its
request message (:mod:`handshake.messages`, its bound in
:mod:`handshake.bounds`, its client call in :mod:`handshake.client`) and its
entry in the server's table (:mod:`handshake.dispatch`, the handler keyword
in :mod:`handshake.server`); the prefill side that answers it
(:mod:`p2pkv.prefill`) and its handler in :func:`p2pkv.worker.way_handlers`;
and, when a load itself fixes the way (as a grant fixes ``stream``),
:attr:`p2pkv.metadata.LoadSpec.way` and the scheduler code that builds such
a load (:mod:`p2pkv.scheduling.load_scheduling`). The lifecycle modules
(``receiver``, ``deadlines``, ``endings``, ``pushes``, ``drain``,
``part_moves``, ``transfer``) need no change unless it needs a trait they do
not ask yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from handshake.messages import HoldQuery, PushRequest, Request, StreamRequest

Window = Literal["transfer_timeout_s", "stream_timeout_s"]
"""The setting whose seconds bound a way's wait for its bytes (:class:`p2pkv.config.P2pKvConfig`)."""


@dataclass(frozen=True)
class Way:
    """One way KV moves, as both sides know it.

    Attributes:
        name: its name: the ``transfer_mode`` word and the value of its
            :class:`p2pkv.decode.direction.Direction` (the metric and span label).
        requests: the side-channel requests the decode rank sends for this way
            alone (lease heartbeats and releases serve every way).
        handler: the :class:`handshake.HandshakeServer` keyword by which the
            prefill worker passes the handler of ``requests``
            (:func:`p2pkv.worker.way_handlers`).
        mover: the name of its decode mover class in :mod:`p2pkv.decode.movers`.
        notifies_done: the decode rank tells each prefill rank it answers for
            "done" once the load landed (False: the prefill rank ends its own
            hold when its WRITEs end, so nobody is notified, and a load that
            takes nothing is released there at once instead).
        retried: a failed part is retried once after a new handshake (False:
            the request it sent serves once, and only that prefill had it).
        lasts_prefill: its bytes come while the prefill computes them: its
            wait is bounded by ``stream_timeout_s`` (:attr:`window`) and
            polled at the slower pace of a wait for a forward.
        watched: the prefill rank of a part waiting for its notification is
            asked whether it can still WRITE it (:mod:`p2pkv.decode.stream_watch`).
        given_up_at_request_end: a load whose request ended while it ran
            (``P2pKvMetadata.ended_streams``) is given up.
        prefill_writes: the prefill rank WRITEs into this rank's memory (its
            agent stays loaded while a part may still land).
        verified: ``verify_kv`` checks its parts against the prefill rank's digests
            (:mod:`p2pkv.decode.verify`; False: it cannot).
    """

    name: str
    requests: tuple[type[Request], ...]
    handler: str
    mover: str
    notifies_done: bool = True
    retried: bool = True
    lasts_prefill: bool = False
    watched: bool = False
    given_up_at_request_end: bool = False
    prefill_writes: bool = False
    verified: bool = True

    @property
    def window(self) -> Window:
        """The setting whose seconds bound its wait for its bytes: ``stream_timeout_s`` when it lasts the
        prefill, else ``transfer_timeout_s``."""
        return "stream_timeout_s" if self.lasts_prefill else "transfer_timeout_s"


PULL = Way("pull", (HoldQuery,), "on_heartbeat", "ReadMover")
"""The decode rank READs; fence questions (:class:`handshake.HoldQuery`) before and after, answered by the
prefill worker's hold callback."""

PUSH = Way("push", (PushRequest,), "on_push", "PushMover", prefill_writes=True)
"""The prefill rank WRITEs the rows of a :class:`handshake.PushRequest` after the prefill."""

STREAM = Way("stream", (StreamRequest,), "on_stream", "StreamMover", notifies_done=False, retried=False,
             lasts_prefill=True, watched=True, given_up_at_request_end=True, prefill_writes=True)
"""The prefill rank WRITEs each layer into the blocks of a :class:`handshake.StreamRequest` as it computes it."""

WAYS: dict[str, Way] = {way.name: way for way in (PULL, PUSH, STREAM)}
"""Every way, by name: the one registry."""
