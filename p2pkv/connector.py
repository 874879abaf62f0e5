"""``P2pKvConnector``: the vLLM ``KVConnectorBase_V1`` entry point (role dispatch; what peers must share).

Installing p2pkv registers it with vLLM (see :mod:`p2pkv.plugin`), so::

    --kv-transfer-config '{"kv_connector": "P2pKvConnector", "kv_role": "kv_both"}'

loads it; ``"kv_connector_module_path": "p2pkv.connector"`` works too.

Scheduler-side calls go to :class:`p2pkv.scheduler.SchedulerSide`,
worker-side calls to :class:`p2pkv.worker.WorkerSide`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from handshake.fingerprints import fingerprint
from p2pkv.config import P2pKvConfig, load_config
from p2pkv.config import engine_role as p2pkv_role
from p2pkv.engine_facts import (
    check_kv_cache_supported,
    check_parallelism_supported,
    check_stages_supported,
    compat_fields,
    layer_groups,
    model_info,
    num_kv_cache_groups,
    recompute_tokens,
    state_group_indices,
    state_layer_names,
)
from p2pkv.metadata import P2pKvMetadata
from p2pkv.params import MAX_BLOCK_IDS
from p2pkv.scheduler import SchedulerSide
from p2pkv.telemetry.metrics import P2pKvPromMetrics, P2pKvStats
from p2pkv.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("p2pkv.connector")


class P2pKvConnectorMetadata(P2pKvMetadata, KVConnectorMetadata):
    """:class:`~p2pkv.metadata.P2pKvMetadata` as the ``KVConnectorMetadata`` vLLM passes on."""


def max_blocks(vllm_config: VllmConfig) -> int:
    """Most block ids per KV cache group a decode request's params may name: ``max_model_len`` (tokens: a block
    holds at least one), or :data:`p2pkv.params.MAX_BLOCK_IDS` without a model config."""
    length = getattr(vllm_config.model_config, "max_model_len", None)
    return min(int(length), MAX_BLOCK_IDS) if isinstance(length, int) and length > 0 else MAX_BLOCK_IDS


def side_channel_host(config: P2pKvConfig) -> str:
    """The host this engine's side channel binds to and advertises."""
    if config.side_channel_host:
        return config.side_channel_host
    from vllm.utils.network_utils import get_ip

    return get_ip()


DECLINED_HOOKS: dict[str, str] = {
    # vLLM's own bookkeeping on the base class, kept as it is
    "bind_connector_metadata": "base bookkeeping: keeps the step's metadata that the worker hooks read",
    "clear_connector_metadata": "base bookkeeping: drops the step's metadata after the forward",
    "has_connector_metadata": "base bookkeeping",
    "bind_kv_cache_manager": "base bookkeeping: keeps the scheduler's KV cache manager (p2pkv reads none of it)",
    "role": "base bookkeeping: the role vLLM built the connector for",
    # what p2pkv does not do
    "unregister_kv_caches": "sleep mode: supports_sleep_mode is False (registered NIXL memory does not follow "
                            "the remap), so vLLM does not sleep an engine with p2pkv",
    "restore_kv_caches": "sleep mode, as unregister_kv_caches",
    "get_mem_pool_context": "the engine's default memory pool: NIXL registers the KV tensors vLLM allocates",
    "set_host_xfer_buffer_ops": "no host staging buffer: NIXL moves the KV tensors where they are",
    "finish_forward": "no work waits for the model to stop reading a step's KV (streams end in wait_for_save)",
    "reset_capture_state": "the base's no-op: p2pkv's worker hooks record nothing while CUDA graphs are "
                           "captured (not checked on a GPU)",
    "handle_preemptions": "no asynchronous saves: held blocks stay allocated until released, and a preempted "
                          "stream is restarted from SchedulerOutput.preempted_req_ids in build_connector_meta",
    "get_kv_connector_kv_cache_events": "p2pkv adds nothing to a prefix cache: no KV cache events",
    "take_events": "p2pkv adds nothing to a prefix cache: no KV cache events",
    "get_handshake_metadata": "p2pkv handshakes over its own side channel (the handshake package), not vLLM's",
    "set_xfer_handshake_metadata": "as get_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware": "as get_handshake_metadata (the base refuses pipeline-parallel "
                                            "metadata; p2pkv moves KV between TP ranks only)",
    "build_connector_worker_meta": "workers report through get_finished / get_transfer_results and stats only",
    "get_finished_count": "the default (one report per worker of the engine): every worker reports each request",
    "bind_gpu_block_pool": "no per-block state: a hold is a request's blocks that vLLM keeps allocated",
    "get_external_cache_hit_sources": "one source for every loaded token (the base's default label)",
    "register_finished_partial_tail": "no partial-tail offloads: a held request keeps all its blocks",
    "has_pending_block_frees": "False: a hold ends when its decode engine pulls or its lease ends, not soon "
                               "enough to stand in for a preemption",
    "has_pending_push_work": "False: a stream's WRITEs are posted in the steps that compute its prompt (the "
                             "last in wait_for_save), and its blocks stay held (request_finished) until the "
                             "workers report them sent",
    "requires_kv_delivery": "the base's default (a KV producer must deliver: a preempted held request is "
                            "recomputed)",
    "requires_piecewise_for_cudagraph": "the base's False; p2pkv is tested on CPU, without CUDA graphs",
    "supports_divergent_local_hybrid_hits": "False: p2pkv moves a request's own blocks, it restores no "
                                            "lagging recurrent state",
    "reset_cache": "p2pkv keeps no cache of its own to reset",
}
"""Public hooks of vLLM's ``KVConnectorBase_V1`` (0.32 and 0.33) that p2pkv leaves to the base class, each with
why. ``tests/test_vllm_release.py`` fails when a checked vLLM release has a hook p2pkv neither overrides nor
lists here, or when an override's signature does not fit the release's."""


class P2pKvConnector(KVConnectorBase_V1, SupportsHMA):
    """Peer-to-peer KV pulls over NIXL for prefill/decode disaggregation.

    ``kv_transfer_params`` are wire-compatible with vLLM's NixlConnector.
    Supports vLLM's hybrid KV cache manager (``SupportsHMA``): models with
    several attention types (full and sliding-window layers) keep one KV
    cache group per type, and a pull moves every group's blocks (only those
    inside the window for a sliding-window group). A hybrid model's
    Mamba/SSM state group moves with them (one state block per request).
    Settings come from ``kv_connector_extra_config`` (see
    :class:`p2pkv.config.P2pKvConfig`).

    Raises:
        p2pkv.config.ConfigError: a bad setting (names the key).
        p2pkv.engine_facts.UnsupportedKVCacheError: a KV cache group p2pkv cannot
            move (see :func:`p2pkv.engine_facts.check_kv_cache_supported`).
        p2pkv.engine_facts.UnsupportedParallelismError: a pipeline-parallel engine that loads KV
            (see :func:`p2pkv.engine_facts.check_parallelism_supported`).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_kv_cache_supported(kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = load_config(ktc.kv_connector_extra_config)
        engine_role, warning = p2pkv_role(self.config, ktc.kv_role)
        pc = vllm_config.parallel_config
        check_parallelism_supported(pc.pipeline_parallel_size, engine_role)
        if pc.pipeline_parallel_size > 1:
            check_stages_supported(kv_cache_config)
        self.engine_id: str = str(ktc.engine_id)
        self.tp_size = pc.tensor_parallel_size
        self.pp_size = pc.pipeline_parallel_size
        base_port = self.config.side_channel_port + pc.data_parallel_index * self.tp_size * self.pp_size
        host = side_channel_host(self.config)
        block_size = vllm_config.cache_config.block_size
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if warning:
                logger.warning(warning)
            self.scheduler = SchedulerSide(self.engine_id, self.config, block_size, host,
                                           base_port, self.tp_size,
                                           recompute_tokens(kv_cache_config),
                                           num_kv_cache_groups(kv_cache_config),
                                           max_blocks=max_blocks(vllm_config), role=engine_role,
                                           num_blocks=getattr(kv_cache_config, "num_blocks", None),
                                           state_groups=state_group_indices(kv_cache_config),
                                           pp_size=self.pp_size)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
            pp_rank = get_pp_group().rank_in_group if self.pp_size > 1 else 0
            compat = fingerprint(compat_fields(vllm_config, kv_cache_config))
            self.worker = WorkerSide(self.engine_id, self.config, tp_rank, self.tp_size, host,
                                     base_port + pp_rank * self.tp_size + tp_rank, compat,
                                     model_info(vllm_config, kv_cache_config), role=engine_role,
                                     pp_rank=pp_rank, pp_size=self.pp_size)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Ask for cross-layer blocks (``BLHNC``) unless configured otherwise.

        vLLM falls back to the attention backend's own layout (and logs it)
        when the backend cannot use the one asked for; the worker then
        describes whatever layout it got.
        """
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        ktc = vllm_config.kv_transfer_config
        layout = load_config(ktc.kv_connector_extra_config if ktc else None).kv_layout
        return None if layout == "auto" else layout

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: registered NIXL memory does not follow vLLM's sleep-mode remap (vLLM >= 0.33)."""
        return False

    # ---- worker side ---------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks,
                                       state_layer_names(self._kv_cache_config),
                                       layer_groups(self._kv_cache_config),
                                       state_group_indices(self._kv_cache_config))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, P2pKvMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """A layer's forward is done: its pages of this step's streamed requests may be WRITTEN
        (:mod:`p2pkv.prefill.prefill_streams`; nothing when none streams)."""
        if self.worker is not None:
            meta = self._get_connector_metadata()
            assert isinstance(meta, P2pKvMetadata)
            self.worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        """The step's forward is done: streams whose prompt it finished send their last layers and end."""
        if self.worker is not None:
            self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished holds and pulls, and the pulls that failed (vLLM's per-request failure report).

        A failed pull is reported by block (:meth:`get_block_ids_with_load_errors`),
        which lets vLLM keep the blocks that did load, or by request here where
        that cannot be right
        (:attr:`p2pkv.dataplane.negotiate.ModelInfo.load_fails_by_request`: several
        KV cache groups, or an attention window).
        """
        assert self.worker is not None
        sending, recving = self.worker.get_finished()
        failed = self.worker.take_failed()
        if not self.worker.model.load_fails_by_request:
            failed = set()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's pull statistics since the last step (None when there are none)."""
        if self.worker is None:
            return None
        data = self.worker.take_stats()
        return None if data is None else P2pKvStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuild shipped stats in vLLM's logger process."""
        return P2pKvStats(data=data) if data is not None else P2pKvStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        """p2pkv's Prometheus metrics on the engine's ``/metrics`` (see :mod:`p2pkv.telemetry.metrics`)."""
        return P2pKvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # ---- scheduler side ------------------------------------------------------
    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The KV cache groups a load restores for ``request``: every transfer group, since p2pkv moves the
        request's own blocks of each (vLLM zeroes the new blocks of the groups not named; its base names only the
        prefix-cacheable ones, which would zero a loaded group of a spec that is not, such as
        ``CircularBufferSpec``). As vLLM's NixlConnector."""
        config = self._kv_cache_config
        if config is None:
            return (0,)
        return tuple(config.transfer_group_ids)

    # No exception may leave a scheduler hook (it would end vLLM's engine loop): an
    # unexpected one is logged once and the request is prefilled locally, or its
    # pull is reported failed, or its blocks are freed.
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        try:
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            logger.exception("p2pkv: request %s: get_num_new_matched_tokens failed; prefilling it locally",
                             request.request_id)
            if isinstance(request.kv_transfer_params, dict):
                request.kv_transfer_params["do_remote_prefill"] = False
            return 0, False

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        try:
            self.scheduler.on_new_request(request)
        except Exception:
            logger.exception("p2pkv: request %s: on_new_request failed (no lease heartbeats for it)",
                             request.request_id)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        try:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:
            logger.exception("p2pkv: request %s: update_state_after_alloc failed; its pull counts as failed",
                             request.request_id)
            self.scheduler.fail_load(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        meta = self.scheduler.build_connector_meta(scheduler_output)
        values = {f.name: getattr(meta, f.name) for f in dataclasses.fields(P2pKvMetadata)}
        values["idle"] = scheduler_output.total_num_scheduled_tokens == 0
        return P2pKvConnectorMetadata(**values)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' step output: holds they released (``finished_sending``) count no more against the cap."""
        assert self.scheduler is not None
        if connector_output.finished_sending:
            self.scheduler.on_sent(connector_output.finished_sending)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        try:
            return self.scheduler.request_finished_all_groups(request, block_ids)
        except Exception:
            logger.exception("p2pkv: request %s: request_finished failed; freeing its blocks now", request.request_id)
            return False, None
