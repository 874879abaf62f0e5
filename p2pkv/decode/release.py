"""Freeing the prefill holds of a pull that failed.

A pull that has failed for good (a peer failure is retried once, after a
fresh handshake; see :class:`p2pkv.decode.receiver.Receiver`) is not tried
again: vLLM recomputes the request's blocks on the decode engine (or fails
the request, per ``kv_load_failure_policy``). The prefill engine would
otherwise keep the request's blocks until its lease ends (``lease_s``) —
for a pull refused at handshake, every time. So the decode rank tells each
prefill rank it answers for (those its "done" notifications go to) to free
the request now, over the side channel (:func:`handshake.release_holds`),
on the worker's bounded pool of side-channel calls
(:class:`p2pkv.decode.background.Background`: at most
:data:`~p2pkv.decode.background.CALLS_PER_HOST` at once per host; when the
worker closes, given :data:`~p2pkv.decode.background.FLUSH_S` to end, then
cancelled). A prefill rank that cannot be reached keeps the lease as its
fallback.
"""

from __future__ import annotations

import logging
import threading

from handshake import Destination, HandshakeError, release_holds
from p2pkv.decode.background import Background
from p2pkv.params import RemotePrefill

logger = logging.getLogger("p2pkv.decode")


def release_failed(background: Background, remote: RemotePrefill, ranks: list[int], reader: str,
                   secret: bytes | None, timeout_s: float) -> None:
    """Ask prefill ranks ``ranks`` of ``remote`` to free ``remote.request_id`` now (asynchronously).

    Args:
        background: where the side-channel calls run (flushed, then cancelled, with the worker).
        remote: the failed pull's source.
        ranks: prefill tp_ranks to tell (port = ``remote.port`` + rank).
        reader: this decode rank's name, sent as the requester.
        secret: side-channel HMAC secret (None: insecure).
        timeout_s: wait for each rank's answer (seconds).
    """
    for rank in ranks:
        background.call(f"p2pkv-release-{remote.host}:{remote.port + rank}", free_hold, remote, rank, reader,
                        secret, timeout_s, key=remote.host, flush=True)


def free_hold(remote: RemotePrefill, rank: int, requester: str, secret: bytes | None, timeout_s: float,
              cancel: threading.Event | None = None) -> int:
    """Blocking: ask prefill rank ``rank`` of ``remote`` to free its hold of ``remote.request_id`` now.

    The prefill rank frees it only when it holds that request with exactly
    ``remote.block_ids`` (the params' blocks, every KV cache group), so
    params naming another request's id free nothing.

    Returns:
        1 if it held it (and frees it), else 0. A rank that cannot be reached
        is logged and counts 0: its lease frees the blocks.
    """
    host, port = remote.host, remote.port + rank
    try:
        return release_holds(Destination(host, port, remote.engine_id, rank), [remote.request_id],
                             [list(remote.block_ids)], requester, secret=secret, timeout_s=timeout_s,
                             cancel=cancel).accepted
    except HandshakeError as exc:
        logger.warning("p2pkv: %s could not free prefill request %s on %s:%d (%s); its lease frees it",
                       requester, remote.request_id, host, port, exc)
        return 0
