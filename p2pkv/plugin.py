"""vLLM plugin hook: makes ``"kv_connector": "P2pKvConnector"`` work without ``kv_connector_module_path``.

Installed as the ``vllm.general_plugins`` entry point ``p2pkv``; vLLM calls
:func:`register` in every process it starts (API server, engine core,
workers) before it reads ``--kv-transfer-config``.
"""

from __future__ import annotations

CONNECTOR_NAME = "P2pKvConnector"


def register() -> None:
    """Register :class:`p2pkv.connector.P2pKvConnector` with vLLM's connector factory (idempotent).

    The connector module is imported only when vLLM creates a connector.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "p2pkv.connector", CONNECTOR_NAME)
