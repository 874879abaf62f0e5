"""The prompt digest: which prompt tokens a request's KV is of.

A prefill engine names the tokens it computed (``kv_transfer_params.remote_prompt_digest``,
:data:`DIGEST_KEY`) and a stream's prefill rank the tokens it streams; the decode engine loads that KV only when
the digest is that of its own prompt's tokens, so KV of another prompt is never served.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence

DIGEST_KEY = "remote_prompt_digest"
"""``kv_transfer_params`` key of the prefill prompt's :func:`prompt_digest`."""
DIGEST_FORM = re.compile(r"[0-9a-f]{32}")
"""A digest's wire form: 32 lowercase hex digits."""


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (first 128 bits, hex) of prompt token ids as little-endian int64s: which tokens a hold's KV is of.

    Args:
        token_ids: the prompt's token ids (ints).

    Returns:
        32 lowercase hex digits (:data:`DIGEST_FORM`).

    Raises:
        OverflowError: a token id beyond int64 (no tokenizer makes one).
    """
    try:
        packed = struct.pack(f"<{len(token_ids)}q", *token_ids)  # the fastest packing of a list of ints here
    except struct.error as exc:
        raise OverflowError(f"a prompt token id does not fit an int64: {exc}") from exc
    return hashlib.sha256(packed).hexdigest()[:32]
