"""The bundled OpenAI-compatible prefill/decode proxy.

For each ``/v1/completions`` or ``/v1/chat/completions`` request it asks a
prefill engine for one token with ``kv_transfer_params={"do_remote_decode":
true}``, then sends the original request with the returned
``kv_transfer_params`` to a decode engine and streams its answer back. The
protocol is vLLM NixlConnector's, so the same proxy fronts either connector.
"""

from __future__ import annotations

from p2pkv.proxy.app import RoundRobin, create_app

__all__ = ["RoundRobin", "create_app"]
