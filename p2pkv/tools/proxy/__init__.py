"""The bundled OpenAI-compatible prefill/decode proxy.

For each ``/v1/completions`` or ``/v1/chat/completions`` request it asks a
prefill engine for one token with ``kv_transfer_params={"do_remote_decode":
true}``, then sends the original request with the returned
``kv_transfer_params`` to a decode engine and streams its answer back. The
protocol is vLLM NixlConnector's, so the same proxy fronts either connector.

Run it with ``p2pkv proxy`` or ``python -m p2pkv.tools.proxy --prefill HOST:PORT ...
--decode HOST:PORT ...``; it also serves ``/health``, ``/v1/models`` and
``/metrics``. With ``--otlp-traces-endpoint`` (or the ``OTEL_EXPORTER_OTLP_*``
variables) each request is traced (:mod:`p2pkv.tools.proxy.spans`, docs/tracing.md).
"""

from __future__ import annotations

from p2pkv.tools.proxy.app import RoundRobin, create_app
from p2pkv.tools.proxy.metrics import ProxyMetrics
from p2pkv.tools.proxy.upstream import PREFILL_PARAMS, UpstreamError, prefill_body

__all__ = ["PREFILL_PARAMS", "ProxyMetrics", "RoundRobin", "UpstreamError", "create_app", "prefill_body"]
