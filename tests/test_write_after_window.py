"""No WRITE lands in blocks the decode side has handed back: a push or stream WRITE delayed past its window.

Two real :class:`p2pkv.worker.WorkerSide` in this process (a prefill rank and a decode rank, UCX moving host
memory). The prefill rank's NIXL agent holds its next WRITE back (:class:`HeldWrite`): NIXL reports it in
flight and refuses to cancel it, as a WRITE still moving bytes over a slow link does, until the test lets it
go, after the decode rank's window has passed. The decode rank must keep the blocks from vLLM (not report the
request) until that WRITE has ended: the prefill rank's word comes only then. Before, it handed them back a
reply timeout after the window, and the late WRITE landed in blocks vLLM had reused.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from p2pkv.metadata import LoadSpec, P2pKvMetadata
from p2pkv.params import RemotePrefill
from tests.test_stream_abort import SOURCE, TARGET, Pair, _pair, _stream, _wait_released

WINDOW_S = 1.0
HELD_S = 3.0  # the WRITE is let go this long after the window began: well past the window and a reply timeout


class HeldWrite:
    """The prefill rank's ``nixl_agent``, but its next WRITE is held back: not posted to NIXL until
    :meth:`let_go`, reported in flight meanwhile, and its handle not released (NIXL's refusal to cancel a WRITE
    still active)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.held: list[object] = []
        self.armed = True
        self.let_go_at: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def transfer(self, handle: object, *args: Any, **kwargs: Any) -> str:
        if self.armed:
            self.armed = False
            self.held.append(handle)
            return "PROC"
        return self.real.transfer(handle, *args, **kwargs)

    def check_xfer_state(self, handle: object) -> str:
        if any(h is handle for h in self.held):
            return "PROC"
        return self.real.check_xfer_state(handle)

    def release_xfer_handle(self, handle: object) -> None:
        if any(h is handle for h in self.held):
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: the transfer is still active")
        self.real.release_xfer_handle(handle)

    def let_go(self) -> None:
        """Post the held WRITE to NIXL now (its bytes and notification land late)."""
        held, self.held = self.held, []
        self.let_go_at = time.monotonic()
        for handle in held:
            self.real.transfer(handle)


def _hold_next_write(pair: Pair) -> HeldWrite:
    agent = pair.prefill.agent
    assert agent is not None
    held = HeldWrite(agent._agent)
    agent._agent = held
    return held


def _wait_until(held: HeldWrite, pair: Pair, want: str, seconds: float) -> None:
    """Step the decode worker for ``seconds`` while the WRITE is held: ``want`` must not be reported."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pair.decode.step()
        pair.prefill.get_finished()
        assert want not in pair.decode.finished, "blocks handed back to vLLM while a WRITE into them was in flight"
        time.sleep(0.01)


@pytest.mark.parametrize("way", ["push", "stream"])
def test_a_write_delayed_past_the_window_ends_before_the_blocks_go_back(way: str) -> None:
    settings = {"transfer_timeout_s": WINDOW_S, "handshake_timeout_s": 0.5, "transfer_mode": "push"}
    with _pair(17, settings, stream_min_tokens=0) as pair:
        held = _hold_next_write(pair)
        started = time.monotonic()
        if way == "push":
            pair.prefill.start_load_kv(P2pKvMetadata(send_leases={"p-1": time.monotonic() + 60},
                                                     send_blocks={"p-1": SOURCE}))
            remote = RemotePrefill("prefill-engine", "p-1", "127.0.0.1", pair.port, SOURCE, 1)
            pair.decode.start(LoadSpec("d-1", TARGET, SOURCE, remote))
        else:
            chunk, load = _stream("p-1", "d-1", pair.port)
            step = P2pKvMetadata(streams=[chunk])
            pair.prefill.start_load_kv(step)
            pair.decode.start(load)
            for layer in range(4):
                pair.prefill.save_kv_layer(f"layers.{layer}", step)
            pair.prefill.wait_for_save()  # the last layer's WRITE, with the notification, is the one held
        _wait_until(held, pair, "d-1", started + HELD_S - time.monotonic())
        assert held.held, "the WRITE was never posted"
        held.let_go()
        assert not pair.decode.pump({"d-1"}, 20.0), "the decode rank never handed its blocks back"
        assert pair.decode.finished_at["d-1"] >= held.let_go_at, "handed back before the late WRITE was posted"
        assert torch.equal(pair.decode.base[list(TARGET)], pair.source[list(SOURCE)]), \
            "the late WRITE's bytes are not all in the blocks it was given"
        if way == "stream":
            pair.prefill.start_load_kv(P2pKvMetadata(send_leases={"p-1": time.monotonic() + 60},
                                                     send_blocks={"p-1": SOURCE}))
        _wait_released(pair.prefill, "p-1")
