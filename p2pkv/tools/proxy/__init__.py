"""The bundled OpenAI-compatible prefill/decode proxy.

For each ``/v1/completions`` or ``/v1/chat/completions`` request it asks a
prefill engine for one token with ``kv_transfer_params={"do_remote_decode":
true}``, then sends the original request with the returned
``kv_transfer_params`` to a decode engine and streams its answer back. The
protocol is vLLM NixlConnector's, so the same proxy fronts either connector.

Run it with ``p2pkv proxy`` or ``python -m p2pkv.tools.proxy --prefill HOST:PORT ...
--decode HOST:PORT ...``; it also serves ``/health``, ``/v1/models`` and
``/metrics``. With ``--otlp-traces-endpoint`` (or the ``OTEL_EXPORTER_OTLP_*``
variables) each request is traced (:mod:`p2pkv.tools.proxy.proxy_spans`, docs/tracing.md).

The names below are imported when first used, so the ``p2pkv`` command's
other subcommands (``doctor``, ``trace``) run where FastAPI is not
installed, e.g. on a GPU node that only moves KV caches.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"RoundRobin": "app", "create_app": "app", "ProxyMetrics": "proxy_metrics", "PREFILL_PARAMS": "upstream",
            "UpstreamError": "upstream", "prefill_body": "upstream"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """``from p2pkv.tools.proxy import create_app`` and the others: imported from their module on first use.

    Raises:
        AttributeError: ``name`` is not one of :data:`__all__`.
    """
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
