"""The one count of what a prefill engine holds for remote engines, whatever the way, against one cap.

Every way of moving KV passes through here before it holds a block: a pull
or a push when its prefill request finishes
(:meth:`p2pkv.scheduling.hold_scheduling.PrefillScheduling.request_finished`), a
layer stream when its request arrives
(:meth:`p2pkv.scheduling.stream_steps.StreamSteps.on_new_request`: the blocks
its prompt will take are counted from then on, since once its stream has a
destination its blocks stay until the stream has ended, whatever else
happens). A way added later counts its holds here too. Past
``max_held_fraction`` of the cache nothing more is held: the request is
answered without a hold (pull, push) or not streamed, and the decode engine
computes the prompt itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HoldLedger:
    """Blocks held (or, for a stream, promised) for remote engines, per prefill request id.

    Attributes:
        cap: most blocks held at once (None: no cap, the cache's size is not known).
        fraction: ``max_held_fraction``, for the refusal's message.
    """

    cap: int | None
    fraction: float
    _blocks: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, num_blocks: int | None, fraction: float) -> HoldLedger:
        """The ledger of an engine with ``num_blocks`` blocks (None or 0: unknown, no cap) that may hold
        ``fraction`` of them (at least one block)."""
        cap = None if not num_blocks or num_blocks <= 0 else max(1, int(num_blocks * fraction))
        return cls(cap, fraction)

    @property
    def held_blocks(self) -> int:
        """Blocks counted now, over every way."""
        return sum(self._blocks.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._blocks

    def refusal(self, blocks: int) -> str | None:
        """Why ``blocks`` more may not be held now (None: they may)."""
        if self.cap is not None and self.held_blocks + blocks > self.cap:
            return (f"{self.held_blocks} of this engine's blocks are already held for decode engines and {blocks} "
                    f"more would pass max_held_fraction={self.fraction:g} ({self.cap} blocks); the decode engine "
                    "prefills this prompt itself")
        return None

    def count(self, request_id: str, blocks: int) -> None:
        """``request_id`` holds (or has been promised) ``blocks`` blocks from now on, instead of what it had."""
        self._blocks[request_id] = blocks

    def release(self, request_id: str) -> bool:
        """``request_id`` holds nothing any more; True when it held something."""
        return self._blocks.pop(request_id, None) is not None


__all__ = ["HoldLedger"]
