"""Multi-turn reuse's params (docs/multi-turn.md): a decode engine that keeps a finished request's blocks for the
conversation's next turn answers with params naming them (:func:`make_turn_params`), which a router sends as they
are with the next turn's prefill leg; that prefill engine loads them first (:func:`wants_turn_load`), then computes
the tokens after them (vLLM's ``bidirectional_kv_xfer``, whose keys and flags these are)."""

from __future__ import annotations

from typing import Any

from p2pkv.params import make_prefill_response_params, wants_remote_decode, wants_remote_prefill

__all__ = ["TURN_LOADED_KEY", "make_turn_params", "mark_loaded", "wants_load", "wants_turn_load"]

TURN_LOADED_KEY = "_remote_blocks_processed"
"""``kv_transfer_params`` key (vLLM's) set once a request's load has been handed to the workers (or refused): a
prefill leg that loaded an earlier turn's KV keeps ``do_remote_decode``, so this says the load is done."""


def wants_turn_load(params: dict[str, Any] | None) -> bool:
    """True when a prefill leg (``do_remote_decode``) also names blocks a decode engine kept for the
    conversation's earlier turns (``remote_block_ids``: the params that engine answered the last turn with,
    :func:`make_turn_params`; vLLM's ``bidirectional_kv_xfer``), not loaded yet: the prefill engine loads them, then
    computes the rest."""
    return (wants_remote_decode(params) and bool(params.get("remote_block_ids"))  # type: ignore[union-attr]
            and not params.get("do_remote_prefill") and not params.get(TURN_LOADED_KEY))  # type: ignore[union-attr]


def wants_load(params: dict[str, Any] | None) -> bool:
    """True when this engine is to load the request's KV from another engine first: a decode leg
    (:func:`wants_remote_prefill`) or a prefill leg that reuses a kept turn (:func:`wants_turn_load`)."""
    return wants_remote_prefill(params) or wants_turn_load(params)


def mark_loaded(params: dict[str, Any]) -> None:
    """The request's load has been handed to the workers, failed or been refused: never load again (a later
    allocation of more blocks, or its end)."""
    params["do_remote_prefill"] = False
    if wants_remote_decode(params):
        params[TURN_LOADED_KEY] = True


def make_turn_params(**kwargs: Any) -> dict[str, Any]:
    """The params a decode engine answers a finished request with when it keeps its blocks for the
    conversation's next turn (``keep_turns_s``): :func:`make_prefill_response_params` of them (the same keys and
    capability, ``remote_num_tokens`` and ``remote_prompt_digest`` naming every token whose KV is kept: the prompt's
    and the generated ones), with the flags vLLM's ``bidirectional_kv_xfer`` sets (``do_remote_decode`` true,
    ``do_remote_prefill`` false): a router sends them as they are with the next turn's prefill leg
    (:func:`wants_turn_load`).

    Raises:
        ValueError: as :func:`make_prefill_response_params`.
    """
    params = make_prefill_response_params(**kwargs)
    params.update(do_remote_prefill=False, do_remote_decode=True, first_token=False)
    return params
