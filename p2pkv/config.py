"""Typed p2pkv configuration from ``kv_connector_extra_config`` and the environment.

Every key of ``kv_connector_extra_config`` must be a field of
:class:`P2pKvConfig`; an unknown key or a value of the wrong type is refused
with a :class:`ConfigError` that names the key and the fix. Environment
variables ``P2PKV_<FIELD>`` (upper case) override the defaults; the extra
config overrides the environment.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

MAX_CPU = 65535
"""Largest core number ``transfer_cpus`` may name."""


def parse_cpus(text: str) -> frozenset[int]:
    """Core numbers from a ``taskset``-style list: ``""`` (none: threads keep the affinity they inherit),
    ``"3"``, ``"0,2"``, ``"4-7"``, ``"0,4-7"``.

    Raises:
        ValueError: a part is not a core number or an ascending range of them (0 .. :data:`MAX_CPU`).
    """
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a core number or a range of them (e.g. 3, 4-7)")
        first = int(lo)
        last = int(hi) if sep else first
        if first > last or last > MAX_CPU:
            raise ValueError(f"{part!r}: a range goes up, within 0..{MAX_CPU}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


class ConfigError(ValueError):
    """A p2pkv setting is unknown or has a bad value; the message names it."""


MIN_SECRET_BYTES = 16
"""The shortest side-channel secret accepted (bytes, after stripping whitespace)."""

MAX_STREAM_TIMEOUT_S = 3600.0
"""The longest ``stream_timeout_s`` (seconds): the most a side-channel stream request's ``window_s`` may say."""

MAX_LINK_SHARE = 100.0
"""The largest ``stream_min_link_share`` (a layer's link time over its forward time)."""

DEFAULT_LEASE_S = 120.0
"""``lease_s``'s default (seconds)."""

LIFETIME_LEASES = 4
"""How many ``lease_s`` a capability's or stream grant's expiry may lie ahead of the receiving engine's clock
(:attr:`P2pKvConfig.max_lifetime_s`): a prefill engine signs its capabilities for one ``lease_s`` and the
proxy its grants for :data:`p2pkv.grant.GRANT_LIFETIME_S` (120 s, the default lease), so honest params never
come near it, while a signer whose clock runs fast, or a forged far-future expiry, is refused before anything
is remembered for it."""

MAKE_SECRET = 'python -c "import secrets; print(secrets.token_hex(32))"'
"""A command that prints a good secret (64 hex characters)."""


def check_secret(key: bytes, source: str) -> bytes:
    """``key`` if it is long enough to be a side-channel HMAC key.

    Args:
        key: the secret, already stripped of surrounding whitespace.
        source: where it came from, for the message (``P2PKV_SECRET``, a file, a flag).

    Raises:
        ConfigError: ``key`` is shorter than :data:`MIN_SECRET_BYTES` bytes;
            names ``source``, the minimum and how to make one.
    """
    if len(key) < MIN_SECRET_BYTES:
        raise ConfigError(f"{source}: the side-channel secret is {len(key)} bytes, shorter than the minimum "
                          f"{MIN_SECRET_BYTES}; make one with `{MAKE_SECRET}` and give the same value to "
                          "prefill, decode and the proxy")
    return key


class P2pKvConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """p2pkv settings.

    Attributes:
        side_channel_host: address this engine's side channel binds to and
            advertises to peers; ``""`` picks the host's primary IP (the pod
            IP), never loopback unless that is all there is.
        side_channel_port: base TCP port of the side channel; tp_rank ``r``
            of data-parallel rank ``d`` listens on ``port + d * tp_size + r``.
        side_channel_max_connections: most peers connected to one rank's
            side channel at once; newer connections are cut. A prefill rank
            holds one long-lived connection per decode rank that reads from
            it and a few short-lived ones (docs/security.md).
        side_channel_max_handshakes: most connections to one rank's side
            channel at once that are not past their CURVE HELLO (what a peer
            without the secret never gets past); the oldest are cut. Each
            costs at most one 256 KiB frame.
        side_channel_stall_s: seconds a rank's side-channel loop may go
            without a turn (it answers every fence question, heartbeat and
            push request) before a WARNING with every thread's stack is
            logged, once per stall; 0 turns the watchdog off.
        lease_s: seconds a prefill engine holds a finished request's blocks
            for a decode engine to pull them before releasing them anyway.
        heartbeat_interval_s: how often (seconds) a decode engine asks the
            prefill engines to extend the leases of requests still queued
            here; 0 turns heartbeats off; unset means ``lease_s / 4``. Must
            be below ``lease_s``.
        role: what this engine does: ``prefill`` (holds blocks for decode
            engines), ``decode`` (loads from prefill engines; holds nothing for
            anyone: ``do_remote_decode`` is answered without a hold) or
            ``both``; empty: from vLLM's ``kv_role`` (``kv_producer`` prefill,
            ``kv_consumer`` decode, ``kv_both`` both, with a warning that any
            HTTP caller can make the engine hold blocks). See :func:`engine_role`.
        max_held_fraction: most of this engine's KV cache (a fraction of its
            blocks) held for decode engines at once; past it a prefill request
            is answered without a hold (the decode engine prefills it).
        handshake_timeout_s: seconds one side-channel request may take.
        handshake_retries: side-channel attempts before a pull is failed.
        max_clock_skew_s: how far (seconds) a side-channel request's ``sent_at``
            may lie ahead of this engine's clock before it is refused as stale
            (a peer's clock running fast); requests up to 30 s old are accepted.
        transfer_timeout_s: seconds a NIXL READ may stay in flight before
            its blocks are reported as load errors.
        secret: shared secret: every side-channel message is HMAC-SHA256
            signed and verified (prefill, decode and the proxy use the same);
            at least :data:`MIN_SECRET_BYTES` bytes after stripping
            whitespace. Required unless ``insecure``: a side channel without
            one refuses to start. Only from ``P2PKV_SECRET`` (or the struct
            itself): :func:`load_config` refuses it in
            ``kv_connector_extra_config``, which vLLM prints in its log and
            which shows in ``ps``.
        secret_file: a file holding the secret (e.g. a mounted Kubernetes
            Secret); used when ``secret`` is empty.
        insecure: allow a side channel without a secret (anyone who reaches
            its port can read the agent metadata and KV layout, then READ the
            KV cache with NIXL, and release holds); logged as a warning.
        kv_layout: KV cache layout requested from vLLM: ``"BLHNC"``
            (cross-layer blocks, one descriptor per block for all layers;
            vLLM falls back to the backend's own when it cannot), ``"LBHNC"``
            (layer-compact, what vLLM's NixlConnector asks for), or
            ``"auto"`` (ask for nothing).
        nixl_backends: NIXL backends to create (``["UCX"]``).
        nixl_progress_thread: run NIXL's progress thread (one core busy per
            agent; lower latency on idle engines).
        nixl_num_threads: worker threads of the backends (0: NIXL default,
            none). With UCX, a thread pool of this size moves each READ,
            split into pieces of ``nixl_split_mib`` (on one host with
            ``cma``, 2 threads READ about 1.3× faster than one where two
            cores are free: ``docs/benchmarks/transfer-cpu.md``); the threads
            spin while a READ is in flight and sleep otherwise.
        nixl_split_mib: with ``nixl_num_threads`` > 0, READ descriptors are
            cut into pieces of at most this many MiB so the thread pool
            shares one READ; 0: never.
        ucx_error_handling_mode: UCX endpoint error handling, ``"peer"``
            (detects dead peers; NIXL's default) or ``"none"`` (lets UCX use
            shared-memory transports; a dead peer is then noticed only by
            timeouts); ``""`` keeps NIXL's default.
        ucx_num_workers: UCX workers per agent (0: NIXL default).
        report_transport: learn from UCX's own protocol selection which
            transport moves each peer's READs, log it at the first READ
            from the peer (under ``auto`` the probe's; a warning naming the
            fix when GPU memory goes over TCP) and count it in
            ``p2pkv:peer_transport_total``; UCX then also prints each READ
            protocol table on its log stream. Off, ``auto`` always pulls.
        stats_file: when set, every finished pull appends one JSON line
            (request id, peer, bytes, descriptors, seconds) to this file.
        pull_poll_interval_s: seconds between two polls of a decode worker's
            READs in flight by its pulls' thread, between engine steps (see
            :mod:`p2pkv.decode.progress`); 0: no thread, pulls advance only
            when vLLM steps the engine.
        switch_interval_s: Python's thread switch interval (seconds) the
            worker process sets (``sys.setswitchinterval``, only ever lowered),
            so the side-channel server and the pulls' threads get the
            interpreter within it while vLLM's engine thread runs Python
            (Python's default, 5 ms, made each side-channel answer wait up to
            several times that on a busy engine); 0 leaves it unchanged.
        idle_wait_s: longest time (seconds) a worker waits, at the end of an
            engine step that scheduled no tokens, for a pull to finish
            while pulls or holds are pending. vLLM steps such an engine
            back to back only to poll transfers, which keeps a core (two
            processes) busy for as long as a pull runs or a prefill
            request's blocks are held; the wait ends at once when a pull
            finishes. A request arriving meanwhile waits up to this long.
            0: no wait (vLLM's busy stepping).
        stream_idle_wait_s: ``idle_wait_s`` while every pull under way is a
            layer stream waiting for its prefill (which lasts the prefill's
            forward): the pulls' thread ends the wait as soon as a stream
            lands, so it adds nothing to a stream; a request arriving
            meanwhile at an otherwise idle engine waits up to this long.
        stream_poll_interval_s: ``pull_poll_interval_s`` while every pull under
            way is a layer stream waiting for its prefill, at first (seconds);
            the interval then grows to 1 % of the youngest stream's wait so far,
            at most 10 ms (:func:`p2pkv.decode.transfer.stream_poll_interval`):
            a stream's final notification is seen at most that late. Polling
            such a wait as fast as a READ, with the idle steps, kept 0.55-0.65
            of a core busy for the prefill's whole forward on a 2-core CPU host
            that ran both engines (docs/streaming.md).
        stream_timeout_s: decode side: seconds a layer-streamed load may wait
            for its prefill's final notification, counted from its stream
            request (the prefill's queue, its whole forward and the last
            WRITE: it must cover the longest prompt's prefill under load);
            also the window the prefill rank is given (it stops WRITing
            past it) and how long a given-up stream drains. 0 (default):
            ``transfer_timeout_s``. At most 3600.
        stream_min_tokens: prefill side: a layer-streamed request whose
            decode engine loads fewer prompt tokens than this goes as one
            WRITE after its prefill's last layer (a bulk push into the same
            destination) instead of a WRITE per layer, which for short
            prompts cost more than it hid. -1: as measured for the cache's
            kind (:data:`p2pkv.prefill.streams.MEASURED_MIN_TOKENS`: 128
            tokens for a per-layer cache, 512 for a cross-layer one,
            docs/benchmarks/stream-threshold-cpu.md); 0: every one streams.
        stream_min_link_share: prefill side, the link rule: a layer-streamed
            request goes as one WRITE after its prefill's last layer when
            its decode rank's link (measured from earlier streams to it)
            moves one layer's bytes in less than this share of the time the
            forward takes to compute that layer (measured from the layers'
            ``save_kv_layer`` times): there is next to nothing to hide, and
            a WRITE per layer costs CPU beside the forward. 0: every request
            streams layer by layer. Until both speeds are measured, and on
            GPUs (the forward's time is not measured there), requests
            stream layer by layer (:mod:`p2pkv.prefill.stream_measures`,
            docs/streaming.md).
        staging_mib: staging memory (MiB, on the KV cache's device) a
            decode worker allocates, on its first pull from a peer with
            another block size, HND/NHD order or TP size, to receive whole
            remote blocks before the fixup; pulls wait when it is full.
        max_peers: most prefill ranks a decode worker keeps (handshaken,
            or being handshaken) at once. When a pull needs more, the least
            recently used ones no pull needs are dropped (their NIXL remote
            agent and fence connection); when none can be, the pull is
            refused (``kind=refused``). At least the largest prefill TP size
            a single request names (one peer per prefill rank).
        peer_idle_s: a prefill rank no pull has used for this long
            (seconds) is dropped; the next pull from it handshakes again.
        otlp_traces_endpoint: OTLP/HTTP URL the engine's p2pkv spans (holds,
            pulls and their phases) are exported to, e.g.
            ``http://collector:4318/v1/traces``; ``""`` falls back to
            ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``,
            and without those tracing is off (``docs/tracing.md``).
        transfer_mode: who moves a pull's bytes (decode side; ``docs/push.md``):
            ``pull`` (this decode engine READs from the prefill engine),
            ``push`` (it asks the prefill rank to WRITE into its blocks), or
            ``auto`` (a 4 KiB probe READ right after each handshake tells how
            UCX moves that peer's READs: pull where they are zero-copy, push
            where not, e.g. GPU memory over TCP; ``p2pkv.decode.probe``), or
            ``stream`` (a request whose decode leg carries a stream grant is
            layer-streamed: the prefill rank WRITEs each layer as its forward
            computes it; one without a grant is pushed; ``docs/streaming.md``).
            A request's ``kv_transfer_params.p2pkv_transfer_mode`` wins.
        push_max_in_flight: a prefill rank posts at most this many WRITEs at
            once for one decode rank (others wait, decode ranks served in turn).
        push_max_queued: WRITEs a prefill rank lets wait for one decode rank;
            past it a push request is answered ``busy`` (the pull fails and
            vLLM recomputes per ``kv_load_failure_policy``).
        push_max_agents: most decode ranks a prefill rank keeps loaded for
            push (a NIXL remote agent and its WRITE queue each). A new decode
            rank past it takes the place of the least recently used one with
            no WRITE queued or in flight; when every one has, its push
            request is answered ``busy``.
        push_agent_idle_s: a decode rank with no WRITE queued or in flight
            for this long (seconds) is unloaded from the prefill rank (its
            next push request loads it again); one whose WRITE failed is
            unloaded as soon as it has none.
        transfer_cpus: CPU cores (a ``taskset`` list: ``"6,7"``, ``"6-7"``)
            for p2pkv's transfer threads (stream poster, push thread, pulls
            thread); empty: they keep the affinity they inherit from the
            engine thread, so an engine limited to its forward's cores sends
            from those cores (:mod:`p2pkv.transfer_threads`).
    """

    side_channel_host: str = ""
    side_channel_port: int = 5600
    side_channel_max_connections: int = 1024
    side_channel_max_handshakes: int = 64
    side_channel_stall_s: float = 5.0
    lease_s: float = DEFAULT_LEASE_S
    heartbeat_interval_s: float | None = None
    role: Literal["prefill", "decode", "both", ""] = ""
    max_held_fraction: float = 0.5
    handshake_timeout_s: float = 5.0
    handshake_retries: int = 3
    max_clock_skew_s: float = 5.0
    transfer_timeout_s: float = 60.0
    secret: str = ""
    secret_file: str = ""
    insecure: bool = False
    kv_layout: Literal["BLHNC", "LBHNC", "auto"] = "BLHNC"
    nixl_backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    nixl_progress_thread: bool = False
    nixl_num_threads: int = 0
    nixl_split_mib: float = 4.0
    ucx_error_handling_mode: Literal["", "peer", "none"] = ""
    ucx_num_workers: int = 0
    report_transport: bool = True
    stats_file: str = ""
    staging_mib: float = 256.0
    pull_poll_interval_s: float = 0.0002
    switch_interval_s: float = 0.0005
    idle_wait_s: float = 0.002
    stream_idle_wait_s: float = 0.02
    stream_poll_interval_s: float = 0.001
    stream_min_tokens: int = -1
    stream_min_link_share: float = 0.1
    stream_timeout_s: float = 0.0
    max_peers: int = 256
    peer_idle_s: float = 600.0
    otlp_traces_endpoint: str = ""
    transfer_mode: Literal["pull", "push", "auto", "stream"] = "auto"
    push_max_in_flight: int = 4
    push_max_queued: int = 256
    push_max_agents: int = 256
    push_agent_idle_s: float = 60.0
    transfer_cpus: str = ""

    def secret_bytes(self) -> bytes | None:
        """The side-channel HMAC key: ``secret``, else the contents of ``secret_file``, else None.

        Both are stripped of surrounding whitespace (as the proxy does).

        Raises:
            ConfigError: ``secret_file`` cannot be read or is empty, or the
                secret is shorter than :data:`MIN_SECRET_BYTES` bytes.
        """
        if self.secret.strip():
            return check_secret(self.secret.strip().encode(), "P2PKV_SECRET")
        if not self.secret_file:
            return None
        try:
            key = open(self.secret_file, "rb").read().strip()  # noqa: SIM115
        except OSError as exc:
            raise ConfigError(f"secret_file={self.secret_file!r} cannot be read: {exc}") from exc
        if not key:
            raise ConfigError(f"secret_file={self.secret_file!r} is empty; write the shared secret into it")
        return check_secret(key, f"secret_file={self.secret_file!r}")

    def require_secret(self) -> bytes | None:
        """The secret a side channel starts with (None only with ``insecure``).

        Raises:
            ConfigError: no secret and not ``insecure``; names both fixes.
        """
        key = self.secret_bytes()
        if key is None and not self.insecure:
            raise ConfigError(
                "no side-channel secret: set P2PKV_SECRET in the environment (or secret_file=PATH in "
                "kv_connector_extra_config) to the same value on prefill, decode and the proxy; or set "
                "insecure=true to run without one (anyone who reaches the port can read the KV cache)")
        return key

    @property
    def heartbeat_every_s(self) -> float:
        """The heartbeat period in force (seconds; 0 = off)."""
        return self.lease_s / 4 if self.heartbeat_interval_s is None else self.heartbeat_interval_s

    @property
    def max_lifetime_s(self) -> float:
        """How far (seconds) past this engine's clock a capability's or stream grant's expiry may lie:
        :data:`LIFETIME_LEASES` × ``lease_s``, never less than that many default leases (480 s: a short
        ``lease_s`` must not refuse the proxy's 120 s grants). Later ones are refused, so what an engine
        remembers of them (bound stream ids, bound capabilities) lasts at most this long."""
        return LIFETIME_LEASES * max(self.lease_s, DEFAULT_LEASE_S)

    @property
    def stream_window_s(self) -> float:
        """How long a layer-streamed load may wait for its prefill (seconds): ``stream_timeout_s``, or
        ``transfer_timeout_s`` when that is 0."""
        return self.stream_timeout_s or self.transfer_timeout_s

    def backend_params(self) -> dict[str, dict[str, str]]:
        """NIXL backend init parameters these settings ask for."""
        ucx: dict[str, str] = {}
        if self.ucx_error_handling_mode:
            ucx["ucx_error_handling_mode"] = self.ucx_error_handling_mode
        if self.ucx_num_workers > 0:
            ucx["num_workers"] = str(self.ucx_num_workers)
        return {"UCX": ucx} if ucx else {}

    def __post_init__(self) -> None:
        _check_settings(self)


_FIELDS = P2pKvConfig.__struct_fields__


def _check_settings(config: P2pKvConfig) -> None:
    """Check every setting's range (pairs of related settings together).

    Raises:
        ConfigError: the first setting out of range, named with its allowed range and its value.
    """
    if not 0 < config.side_channel_port < 65536:
        raise ConfigError(
            f"side_channel_port={config.side_channel_port} is not a TCP port; "
            "use 1..65535 in kv_connector_extra_config or P2PKV_SIDE_CHANNEL_PORT"
        )
    if not 1 <= config.side_channel_max_handshakes <= config.side_channel_max_connections <= 65536:
        raise ConfigError(
            f"need 1 <= side_channel_max_handshakes ({config.side_channel_max_handshakes}) <= "
            f"side_channel_max_connections ({config.side_channel_max_connections}) <= 65536 (connections)")
    if config.side_channel_stall_s < 0:
        raise ConfigError(f"side_channel_stall_s must be >= 0 seconds (0: off), got {config.side_channel_stall_s}")
    for name in ("lease_s", "handshake_timeout_s", "transfer_timeout_s"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0 seconds, got {getattr(config, name)}")
    if not 0 < config.max_held_fraction <= 1:
        raise ConfigError(f"max_held_fraction must be in (0, 1] (a share of the KV cache's blocks), got "
                          f"{config.max_held_fraction}")
    if not 0 <= config.max_clock_skew_s <= 30:
        raise ConfigError(f"max_clock_skew_s must be 0 .. 30 seconds, got {config.max_clock_skew_s}")
    if config.heartbeat_interval_s is not None and not 0 <= config.heartbeat_interval_s < config.lease_s:
        raise ConfigError(
            f"heartbeat_interval_s={config.heartbeat_interval_s} must be >= 0 and below "
            f"lease_s={config.lease_s} (0 turns heartbeats off)"
        )
    if not 0 <= config.pull_poll_interval_s <= 1:
        raise ConfigError(f"pull_poll_interval_s must be 0 (no thread) .. 1 s, got {config.pull_poll_interval_s}")
    if config.nixl_num_threads < 0 or config.nixl_split_mib < 0:
        raise ConfigError(f"nixl_num_threads ({config.nixl_num_threads}) and nixl_split_mib "
                          f"({config.nixl_split_mib}) must be >= 0")
    if not 0 <= config.switch_interval_s <= 0.1:
        raise ConfigError(f"switch_interval_s must be 0 (unchanged) .. 0.1 s, got {config.switch_interval_s}")
    if not 0 <= config.idle_wait_s <= 0.1:
        raise ConfigError(f"idle_wait_s must be 0 (no wait) .. 0.1 s, got {config.idle_wait_s}")
    if not 0 <= config.stream_idle_wait_s <= 0.1:
        raise ConfigError(f"stream_idle_wait_s must be 0 (no wait) .. 0.1 s, got {config.stream_idle_wait_s}")
    if not -1 <= config.stream_min_tokens < 1 << 31:
        raise ConfigError("stream_min_tokens must be a whole number of tokens >= 0 (-1: as measured for the "
                          f"cache's kind), got {config.stream_min_tokens!r}")
    if not 0 <= config.stream_min_link_share <= MAX_LINK_SHARE:
        raise ConfigError(f"stream_min_link_share must be 0 (every request streams layer by layer) .. "
                          f"{MAX_LINK_SHARE:g}, got {config.stream_min_link_share!r}")
    if not 0 <= config.stream_timeout_s <= MAX_STREAM_TIMEOUT_S:
        raise ConfigError(f"stream_timeout_s must be 0 (transfer_timeout_s) .. {MAX_STREAM_TIMEOUT_S:g} seconds, got "
                          f"{config.stream_timeout_s}")
    try:
        parse_cpus(config.transfer_cpus)
    except ValueError as exc:
        raise ConfigError(f"transfer_cpus={config.transfer_cpus!r}: {exc}") from exc
    if not 0 < config.stream_poll_interval_s <= 0.01:
        raise ConfigError(f"stream_poll_interval_s must be above 0 .. 0.01 s, got {config.stream_poll_interval_s}")
    if config.staging_mib < 0.0625:
        raise ConfigError(f"staging_mib must be >= 0.0625 (MiB, 64 KiB), got {config.staging_mib}")
    if config.handshake_retries < 1:
        raise ConfigError(f"handshake_retries must be >= 1, got {config.handshake_retries}")
    if not config.nixl_backends:
        raise ConfigError('nixl_backends must name at least one backend, e.g. ["UCX"]')
    if not 1 <= config.max_peers <= 65536:
        raise ConfigError(f"max_peers must be 1..65536 (prefill ranks), got {config.max_peers}")
    if config.peer_idle_s <= 0:
        raise ConfigError(f"peer_idle_s must be > 0 seconds, got {config.peer_idle_s}")
    if not 1 <= config.push_max_in_flight <= 1024:
        raise ConfigError(f"push_max_in_flight must be 1..1024 (WRITEs per decode rank), got "
                          f"{config.push_max_in_flight}")
    if not 1 <= config.push_max_queued <= 65536:
        raise ConfigError(f"push_max_queued must be 1..65536 (WRITEs per decode rank), got {config.push_max_queued}")
    if not 1 <= config.push_max_agents <= 65536:
        raise ConfigError(f"push_max_agents must be 1..65536 (decode ranks), got {config.push_max_agents}")
    if config.push_agent_idle_s <= 0:
        raise ConfigError(f"push_agent_idle_s must be > 0 seconds, got {config.push_agent_idle_s}")


def _from_env(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _FIELDS:
        raw = environ.get(f"P2PKV_{name.upper()}")
        if raw is None:
            continue
        if name == "nixl_backends":
            out[name] = [b.strip() for b in raw.split(",") if b.strip()]
        else:
            out[name] = raw
    return out


def load_config(
    extra_config: dict[str, Any] | None, environ: dict[str, str] | None = None
) -> P2pKvConfig:
    """Build the config from ``kv_connector_extra_config`` and ``P2PKV_*`` env vars.

    Args:
        extra_config: the ``kv_connector_extra_config`` dict (may be None).
        environ: environment mapping; defaults to ``os.environ``.

    Returns:
        The validated :class:`P2pKvConfig`.

    Raises:
        ConfigError: an unknown key, a value of the wrong type or out of range,
            or a non-empty ``secret`` in ``extra_config`` (vLLM prints the
            extra config in its log, and it is on the engine's command line);
            the message names the key.
    """
    environ = dict(os.environ) if environ is None else environ
    merged: dict[str, Any] = _from_env(environ)
    for key, value in (extra_config or {}).items():
        if key not in _FIELDS:
            raise ConfigError(
                f"unknown p2pkv setting {key!r} in kv_connector_extra_config; "
                f"known settings: {', '.join(_FIELDS)}"
            )
        if key == "secret" and value:
            raise ConfigError(
                "secret in kv_connector_extra_config: it would be printed in vLLM's log (non-default args) and be "
                "visible in `ps`; remove it and set P2PKV_SECRET in the engine's environment or "
                "secret_file=PATH (a file holding the secret)"
            )
        merged[key] = value
    try:
        return msgspec.convert(merged, P2pKvConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad p2pkv setting: {exc} (in kv_connector_extra_config or P2PKV_*)") from exc


Role = Literal["prefill", "decode", "both"]
"""What an engine does with p2pkv: hold blocks for decode engines, load from prefill engines, or both."""

KV_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
"""vLLM's ``kv_role`` → the role it means when ``role`` is not set."""


def engine_role(config: P2pKvConfig, kv_role: str | None) -> tuple[Role, str]:
    """This engine's role, and a warning to log at start ("" for none).

    ``role`` wins; else vLLM's ``kv_role`` decides (:data:`KV_ROLES`; unknown or unset: ``both``). An engine
    that ends up ``both`` without ``role`` set gets the warning: any caller of its HTTP API can make it hold
    blocks (up to ``max_held_fraction`` of its KV cache) by sending ``do_remote_decode``.
    """
    if config.role:
        return config.role, ""
    role = KV_ROLES.get(kv_role or "", "both")
    if role != "both":
        return role, ""
    return role, (f"p2pkv: this engine runs as both prefill and decode (kv_role {kv_role or 'unset'}, no role "
                  "setting): any caller of its HTTP API can make it hold KV blocks for a remote decode (up to "
                  f"max_held_fraction={config.max_held_fraction:g} of its cache) by sending do_remote_decode; set "
                  "kv_connector_extra_config role (prefill or decode), or P2PKV_ROLE, to say what it does")
