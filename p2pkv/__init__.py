"""p2pkv: peer-to-peer, zero-copy KV-cache transfer for vLLM prefill/decode
disaggregation over NIXL.

The vLLM connector lives in :mod:`p2pkv.connector` (class
``P2pKvConnector``); the side channel in the separate :mod:`handshake`
package; the bundled proxy in :mod:`p2pkv.tools.proxy`.
"""

from __future__ import annotations

__version__ = "0.1.0"
