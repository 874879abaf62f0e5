"""The push direction of ``scripts/bench_transfer.py`` (``--mode push``): the prefill side WRITEs.

In push mode the prefill process posts NIXL WRITEs of a request's blocks
from its cache into the decode process's blocks, each carrying a
notification (``p2pkv:bench:push:<id>``) that the decode side waits for, as
a decode engine would wait for a pushing prefill. The descriptor rows are
the ones a pull of the same request uses, with local and remote swapped
(:func:`pair_descriptors`).

Both processes talk over a pipe (:class:`transfer_bench.prefill.SpawnedPrefill`),
request then reply:

===========================================  ======================================================
decode → prefill                             prefill → decode
===========================================  ======================================================
``{"op": "push_peer", "infos": ...}``        ``{"op": "push_peer_ok", "add_remote_agent_ms": ...}``
``{"op": "push_plan", "id": n, ...}``        ``{"op": "push_planned", "plan_s": ..., "descs": ...}``
``{"op": "push", "id": n}``                  ``{"op": "pushed", "xfer_s": ...}`` (after the WRITE is DONE)
``{"op": "stream", "id": n, ...}``           ``{"op": "streamed", ...}`` (:mod:`transfer_bench.stream`)
===========================================  ======================================================

``push_peer`` hands the prefill the decode agent's NIXL metadata and both
destination caches' layouts (one :class:`handshake.AgentInfo` per layout).
``push_plan`` (untimed, like a pull's planning) builds
one request's descriptors on the prefill; ``push`` posts the WRITE and
polls it until DONE. The decode side times a push from sending ``push``
until its agent hands over the WRITE's notification (what a decode engine
waits for); the prefill reports its own post → DONE time (``xfer_s``).

:class:`Pusher` is the prefill's end, :class:`PushClient` the decode's.
Units: seconds unless named (``*_ms``: milliseconds); offsets and lengths in bytes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from p2pkv.dataplane.plan import build_descriptors, coalesce_runs

from transfer_bench.options import METHODS, PEER_LAYOUT

if TYPE_CHECKING:
    from collections.abc import Sequence

    from handshake import AgentInfo
    from p2pkv.dataplane.agent import NixlTransferAgent
    from p2pkv.dataplane.layout import Segment
    from p2pkv.worker import WorkerSide

PUSH_METHODS: dict[str, str] = {m: METHODS[m] for m in ("cross_layer", "per_layer", "layer_coalesced")}
"""Methods measured in push mode (the NIXL methods with one agent per prefill cache) → what they move;
each writes from and into the cache :data:`~transfer_bench.options.PEER_LAYOUT` names."""

WRITE_TIMEOUT_S = 120.0
"""The prefill gives up on a WRITE not DONE after this many seconds (and answers an error)."""

PUSH_NOTIF_PREFIX = b"p2pkv:bench:push:"
"""Start of every push's notification; the request's id follows."""

MODE_LABELS: dict[str, str] = {
    "pull": "the decode side posts NIXL READs; timed from start_read to the poll that sees DONE",
    "push": "the prefill side posts NIXL WRITEs with a notification; timed on the decode side from its ask "
            "(a message over a pipe) to the notification's arrival; writer_xfer_ms: the prefill's post -> DONE",
    "stream": "the prefill side WRITEs each layer once a stand-in forward has computed it (stream) or everything "
              "after its last layer (bulk); wait_after_last_layer_ms: the notification's arrival at the decode "
              "minus the last layer's end",
}
"""What each ``--mode`` measures."""


def pair_descriptors(method: str, local_segments: Sequence[Segment], local_ids: np.ndarray, local_device: int,
                     remote_segments: Sequence[Segment], remote_ids: np.ndarray, remote_device: int,
                     num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """``(local, remote)`` NIXL descriptor rows (uint64 ``[n, 3]``: addr, bytes, device) of one request.

    ``local_*`` is the memory of the agent that posts (the decode's for a
    READ, the prefill's for a WRITE), ``remote_*`` its peer's; block
    ``local_ids[i]`` pairs with ``remote_ids[i]``. ``per_layer``: one row
    per block and segment; otherwise one per run of consecutive blocks
    (:func:`p2pkv.dataplane.plan.coalesce_runs`) and segment. Both caches
    hold ``num_blocks`` blocks.
    """
    if method == "per_layer":
        ones = np.ones(len(local_ids), dtype=np.int64)
        return (build_descriptors(local_segments, np.asarray(local_ids, dtype=np.int64), ones, local_device),
                build_descriptors(remote_segments, np.asarray(remote_ids, dtype=np.int64), ones, remote_device))
    ls, rs, lens = coalesce_runs(local_ids, remote_ids, num_blocks, num_blocks)
    return (build_descriptors(local_segments, ls, lens, local_device),
            build_descriptors(remote_segments, rs, lens, remote_device))


class Pusher:
    """The prefill's end of push mode: posts WRITEs from its caches' agents into the decode's memory.

    Args:
        workers: layout → the WorkerSide serving that cache (its agent posts the WRITEs).
        device_ids: layout → this side's device id (0 for host memory).
        num_blocks: blocks per cache (both sides).
    """

    def __init__(self, workers: dict[str, WorkerSide], device_ids: dict[str, int], num_blocks: int) -> None:
        self.workers, self.device_ids, self.num_blocks = workers, device_ids, num_blocks
        self._peers: dict[str, tuple[str, list[Segment], int]] = {}  # layout → decode agent, segments, device
        self._plans: dict[int, tuple[NixlTransferAgent, str, np.ndarray, np.ndarray]] = {}
        self._forwards: dict[tuple[float, str], Any] = {}  # stream mode: (layer ms, CUDA stream) → its stand-in forward
        self._posters: dict[str, Any] = {}  # stream mode: layout → the StreamPoster of its agent (its WRITE engine)

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one push message (see the module's table); ``{"op": "error", "error": ...}`` when it fails."""
        from p2pkv.dataplane.agent import TransferError

        try:
            if msg.get("op") == "push_peer":
                return self._add_peer(msg)
            if msg.get("op") == "push_plan":
                return self._plan(msg)
            if msg.get("op") == "push":
                return self._push(int(msg["id"]))
            if msg.get("op") == "stream":
                return self._stream(msg)
            return {"op": "error", "error": f"unknown push op {msg.get('op')!r}"}
        except (TransferError, ValueError, KeyError, TypeError) as exc:
            return {"op": "error", "error": f"{msg.get('op')}: {type(exc).__name__}: {exc}"}

    def _agent(self, layout: str) -> NixlTransferAgent:
        agent = self.workers[layout].agent
        if agent is None:
            raise ValueError(f"the prefill's {layout} cache is not registered")
        return agent

    def _add_peer(self, msg: dict[str, Any]) -> dict[str, Any]:
        from p2pkv.dataplane.negotiate import remote_segments

        took = {}
        for layout, info in msg["infos"].items():
            t0 = time.perf_counter()
            name = self._agent(layout).add_peer(info)
            took[layout] = (time.perf_counter() - t0) * 1e3
            self._peers[layout] = (name, remote_segments(info.layout), int(msg.get("device_id", 0)))
        return {"op": "push_peer_ok", "add_remote_agent_ms": took}

    def _plan(self, msg: dict[str, Any]) -> dict[str, Any]:
        method, req = str(msg["method"]), int(msg["id"])
        layout = PEER_LAYOUT[method]
        peer, segments, device = self._peers[layout]
        t0 = time.perf_counter()
        local, remote = pair_descriptors(
            method, self.workers[layout].layout.segments, np.asarray(msg["prefill_ids"], dtype=np.int64),
            self.device_ids[layout], segments, np.asarray(msg["decode_ids"], dtype=np.int64), device,
            self.num_blocks)
        plan_s = time.perf_counter() - t0
        self._plans[req] = (self._agent(layout), peer, local, remote)
        return {"op": "push_planned", "id": req, "plan_s": plan_s, "descs": int(local.shape[0])}

    def _stream(self, msg: dict[str, Any]) -> dict[str, Any]:
        from p2pkv.prefill.poster import StreamPoster
        from p2pkv.prefill.write_engine import WriteEngine

        from transfer_bench.stream import Forward, run_stream

        layout = PEER_LAYOUT[str(msg["method"])]
        peer, segments, device = self._peers[layout]
        key = (float(msg["layer_ms"]), str(msg["forward_stream"]))
        if key not in self._forwards:
            self._forwards[key] = Forward(str(msg["device"]), *key)
        own = self.workers[layout].layout.segments
        if msg["way"] == "bulk":
            msg = {**msg, "rows": pair_descriptors(
                str(msg["method"]), own, np.asarray(msg["prefill_ids"], dtype=np.int64), self.device_ids[layout],
                segments, np.asarray(msg["decode_ids"], dtype=np.int64), device, self.num_blocks)}
        poster = None
        if msg["poster"] == "thread":
            if layout not in self._posters:
                self._posters[layout] = StreamPoster(WriteEngine(self._agent(layout), None))
            poster = self._posters[layout]
        return run_stream(self._agent(layout), list(own), self.device_ids[layout], peer, segments, device,
                          self.num_blocks, int(msg["page_bytes"]), self._forwards[key], poster, msg)

    def _push(self, req: int) -> dict[str, Any]:
        agent, peer, local, remote = self._plans.pop(req)
        t0 = time.perf_counter()
        handle = agent.start_write(peer, local, remote, PUSH_NOTIF_PREFIX + str(req).encode())
        while not agent.poll(handle):
            if time.perf_counter() - t0 > WRITE_TIMEOUT_S:
                agent.cancel(handle)
                raise ValueError(f"push {req}: the WRITE was not DONE within {WRITE_TIMEOUT_S:g} s")
        return {"op": "pushed", "id": req, "xfer_s": time.perf_counter() - t0}


class PushError(RuntimeError):
    """The prefill could not push (its error, or no notification in time)."""


class PushClient:
    """The decode's end of push mode: asks the prefill to push a request and waits for the notification.

    Args:
        link: the spawned prefill process (:class:`transfer_bench.prefill.SpawnedPrefill`:
            ``send``, ``receive(timeout_s)``, ``try_receive()``).
        agent: the decode's NIXL agent (the WRITEs land in its registered memory; it receives the notifications).
        timeout_s: how long to wait for any reply or notification (seconds).
    """

    def __init__(self, link: Any, agent: NixlTransferAgent, timeout_s: float) -> None:
        self.link, self.agent, self.timeout_s = link, agent, timeout_s
        self._next = 0
        self.add_remote_agent_ms: dict[str, float] = {}
        """Layout → how long the prefill's ``add_remote_agent`` of this side took (ms)."""

    def _request(self, msg: dict[str, Any], expect: str) -> dict[str, Any]:
        self.link.send(msg)
        return self._check(self.link.receive(self.timeout_s), expect)

    @staticmethod
    def _check(reply: dict[str, Any], expect: str) -> dict[str, Any]:
        if reply.get("op") != expect:
            raise PushError(f"the prefill could not push: {reply.get('error', reply)}")
        return reply

    def connect(self, infos: dict[str, AgentInfo], device_id: int) -> None:
        """Give the prefill this side's agent and layouts (layout → AgentInfo); ``device_id``: this side's GPU."""
        reply = self._request({"op": "push_peer", "device_id": device_id,
                               "infos": infos}, "push_peer_ok")
        self.add_remote_agent_ms = dict(reply["add_remote_agent_ms"])

    def push(self, method: str, decode_ids: np.ndarray, prefill_ids: np.ndarray) -> tuple[float, float, float, int]:
        """Have the prefill WRITE its blocks ``prefill_ids`` into this side's ``decode_ids``.

        Returns:
            ``(plan seconds on the prefill, seconds from the ask to the
            notification, the prefill's post -> DONE seconds, descriptors)``.

        Raises:
            PushError: the prefill failed, or no notification came within ``timeout_s``.
        """
        req, self._next = self._next, self._next + 1
        plan = self._request({"op": "push_plan", "id": req, "method": method, "decode_ids": decode_ids.tolist(),
                              "prefill_ids": prefill_ids.tolist()}, "push_planned")
        want = PUSH_NOTIF_PREFIX + str(req).encode()
        reply: dict[str, Any] | None = None
        t0 = time.perf_counter()
        self.link.send({"op": "push", "id": req})
        checked = deadline = t0
        deadline += self.timeout_s
        while want not in self.agent.take_notifs(PUSH_NOTIF_PREFIX):
            now = time.perf_counter()
            if now - checked > 0.002 and reply is None:  # a failed WRITE sends no notification, only its error
                checked, reply = now, self.link.try_receive()
                if reply is not None:
                    self._check(reply, "pushed")
            if now > deadline:
                raise PushError(f"{method} push {req}: no notification within {self.timeout_s:g} s")
        seconds = time.perf_counter() - t0
        done = self._check(reply or self.link.receive(self.timeout_s), "pushed")
        return float(plan["plan_s"]), seconds, float(done["xfer_s"]), int(plan["descs"])
