"""Typed p2pkv configuration from ``kv_connector_extra_config`` and the environment.

Every key of ``kv_connector_extra_config`` must be a field of
:class:`P2pKvConfig`; an unknown key or a value of the wrong type is refused
with a :class:`ConfigError` that names the key and the fix. Environment
variables ``P2PKV_<FIELD>`` (upper case) override the defaults; the extra
config overrides the environment. A setting p2pkv no longer has is refused with the
error naming what replaced it (:data:`REMOVED`).
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

DEFAULT_LEASE_S = 120.0
"""``lease_s``'s default (seconds)."""

HEARTBEATS_PER_LEASE = 4
"""A decode engine asks the prefill engines to extend the leases of the requests still queued on it every
``lease_s`` / this (30 s at the default lease): a lease survives three lost heartbeats in a row, and a queued
request costs its prefill rank one id in a batch per interval (docs/reliability.md)."""

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
            of pipeline stage ``s`` of data-parallel rank ``d`` listens on
            ``port + d * tp_size * pp_size + s * tp_size + r``.
        lease_s: seconds a prefill engine holds a finished request's blocks
            for a decode engine to pull them before releasing them anyway.
        role: what this engine does: ``prefill`` (holds blocks for decode
            engines), ``decode`` (loads from prefill engines; holds nothing for
            anyone: ``do_remote_decode`` is answered without a hold) or
            ``both``; empty: from vLLM's ``kv_role`` (``kv_producer`` prefill,
            ``kv_consumer`` decode, ``kv_both`` both, with a warning that any
            HTTP caller can make the engine hold blocks). See :func:`engine_role`.
        max_held_fraction: most of this engine's KV cache (a fraction of its
            blocks) held for decode engines at once; past it a prefill request
            is answered without a hold (the decode engine prefills it).
        handshake_timeout_s: seconds one side-channel request may take (a
            handshake makes :data:`p2pkv.decode.peers.HANDSHAKE_ATTEMPTS`
            attempts of it before its pull fails).
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
        stats_file: when set, every finished pull appends one JSON line
            (request id, peer, bytes, descriptors, seconds) to this file.
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
            kind (:data:`p2pkv.prefill.prefill_streams.MEASURED_MIN_TOKENS`: 128
            tokens for a per-layer cache, 512 for a cross-layer one,
            docs/benchmarks/stream-threshold-cpu.md); 0: every request streams
            layer by layer, the link rule
            (:data:`p2pkv.prefill.stream_measures.MIN_LINK_SHARE`) off too.
        staging_mib: staging memory (MiB, on the KV cache's device) a
            decode worker allocates, on its first pull from a peer with
            another block size, HND/NHD order or TP size, to receive whole
            remote blocks before the fixup; pulls wait when it is full.
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
        transfer_cpus: CPU cores (a ``taskset`` list: ``"6,7"``, ``"6-7"``)
            for p2pkv's transfer threads (stream poster, push thread, pulls
            thread); empty: they keep the affinity they inherit from the
            engine thread, so an engine limited to its forward's cores sends
            from those cores (:mod:`p2pkv.transfer_threads`). Two cores or
            more also give NIXL's UCX backend a thread pool there, one thread
            per core, sharing each READ (:func:`p2pkv.transfer_threads.nixl_threads`).
        verify_kv: decode side: check every pulled, pushed or streamed part
            against the prefill rank's digest of what it sent before vLLM reads it
            (XXH3-64 over the same bytes on both sides: :mod:`p2pkv.decode.verify`);
            a mismatch fails the load (vLLM recomputes or fails the request by
            ``kv_load_failure_policy``). Off by default: on a CPU host it adds
            about 3 % to a pull and 7 % to a push over a 2 Gbit/s link, 1.7-2.6x
            over ``cma`` on one host (docs/benchmarks/verify-cpu.md). KV caches
            in host memory only.
        keep_turns_s: multi-turn reuse (docs/multi-turn.md): seconds a decode
            engine keeps a finished request's blocks (its prompt's and the
            tokens it generated) for the conversation's next turn, whose
            prefill engine loads them instead of computing them again (vLLM's
            ``bidirectional_kv_xfer``); counted against ``max_held_fraction``,
            freed once loaded or at the end. 0 (the default): off. Needs
            ``role`` both on the engines that keep and load turns (each holds
            blocks for the other and loads from it), and at most
            ``max_lifetime_s`` (8 × ``lease_s``: 480 s by default).
    """

    side_channel_host: str = ""
    side_channel_port: int = 5600
    lease_s: float = DEFAULT_LEASE_S
    role: Literal["prefill", "decode", "both", ""] = ""
    max_held_fraction: float = 0.5
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 60.0
    secret: str = ""
    secret_file: str = ""
    insecure: bool = False
    kv_layout: Literal["BLHNC", "LBHNC", "auto"] = "BLHNC"
    nixl_backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    stats_file: str = ""
    staging_mib: float = 256.0
    stream_min_tokens: int = -1
    stream_timeout_s: float = 0.0
    transfer_mode: Literal["pull", "push", "auto", "stream"] = "auto"
    transfer_cpus: str = ""
    verify_kv: bool = False
    keep_turns_s: float = 0.0

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
        """How often (seconds) a decode engine extends the leases of its queued requests: ``lease_s`` /
        :data:`HEARTBEATS_PER_LEASE`."""
        return self.lease_s / HEARTBEATS_PER_LEASE

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
    for name in ("lease_s", "handshake_timeout_s", "transfer_timeout_s"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0 seconds, got {getattr(config, name)}")
    if not 0 < config.max_held_fraction <= 1:
        raise ConfigError(f"max_held_fraction must be in (0, 1] (a share of the KV cache's blocks), got "
                          f"{config.max_held_fraction}")
    if not -1 <= config.stream_min_tokens < 1 << 31:
        raise ConfigError("stream_min_tokens must be a whole number of tokens >= 0 (-1: as measured for the "
                          f"cache's kind), got {config.stream_min_tokens!r}")
    if not 0 <= config.stream_timeout_s <= MAX_STREAM_TIMEOUT_S:
        raise ConfigError(f"stream_timeout_s must be 0 (transfer_timeout_s) .. {MAX_STREAM_TIMEOUT_S:g} seconds, got "
                          f"{config.stream_timeout_s}")
    try:
        parse_cpus(config.transfer_cpus)
    except ValueError as exc:
        raise ConfigError(f"transfer_cpus={config.transfer_cpus!r}: {exc}") from exc
    if config.staging_mib < 0.0625:
        raise ConfigError(f"staging_mib must be >= 0.0625 (MiB, 64 KiB), got {config.staging_mib}")
    if not config.nixl_backends:
        raise ConfigError('nixl_backends must name at least one backend, e.g. ["UCX"]')
    if not 0 <= config.keep_turns_s <= config.max_lifetime_s:
        raise ConfigError(f"keep_turns_s must be 0 (off) .. max_lifetime_s={config.max_lifetime_s:g} seconds "
                          f"(8 x lease_s: what a capability may last), got {config.keep_turns_s}")
    if config.keep_turns_s and config.role not in ("both", ""):
        raise ConfigError(f"keep_turns_s={config.keep_turns_s:g} needs role both (this engine keeps turns for "
                          f"prefill engines and they load from it), got role {config.role}; set role both on the "
                          "engines of a multi-turn deployment")


REMOVED: dict[str, str] = {
    "side_channel_max_connections": "a rank's side channel keeps at most 1024 connections, a constant "
                                    "(handshake.connections.MAX_CONNECTIONS)",
    "side_channel_max_handshakes": "at most 64 connections not past their CURVE HELLO, a constant "
                                   "(handshake.connections.MAX_HANDSHAKES)",
    "side_channel_stall_s": "the side-channel watchdog warns after 5 s without a turn, a constant "
                            "(p2pkv.worker.SIDE_CHANNEL_STALL_S)",
    "heartbeat_interval_s": "heartbeats go every lease_s / 4 (p2pkv.config.HEARTBEATS_PER_LEASE); set lease_s",
    "max_clock_skew_s": "a side-channel request may be dated at most 5 s ahead, a constant "
                        "(handshake.replay.DEFAULT_FUTURE_SKEW_S)",
    "nixl_progress_thread": "NIXL's progress thread is always off (p2pkv.worker.NIXL_PROGRESS_THREAD)",
    "nixl_num_threads": "NIXL's UCX thread pool has one thread per transfer_cpus core when it names two or more "
                        "(p2pkv.transfer_threads.nixl_threads); name the free cores in transfer_cpus",
    "nixl_split_mib": "READs are cut into 4 MiB pieces for NIXL's thread pool, a constant "
                      "(p2pkv.worker.READ_SPLIT_MIB)",
    "handshake_retries": "a handshake makes 3 attempts of handshake_timeout_s each, a constant "
                         "(p2pkv.decode.peers.HANDSHAKE_ATTEMPTS); set handshake_timeout_s",
    "ucx_num_workers": "UCX keeps NIXL's default number of workers",
    "ucx_error_handling_mode": "UCX keeps NIXL's default error handling (peer: a dead peer is detected)",
    "report_transport": "the transport of each peer's READs is always reported (docs/transport.md)",
    "pull_poll_interval_s": "the pulls' thread polls every 0.2 ms, a constant (p2pkv.decode.progress.INTERVAL_S)",
    "switch_interval_s": "the worker lowers Python's switch interval to 0.5 ms, a constant "
                         "(p2pkv.worker.SWITCH_INTERVAL_S)",
    "idle_wait_s": "the wait is now a constant (p2pkv.worker.IDLE_WAIT_S, 2 ms)",
    "stream_idle_wait_s": "the wait is now a constant (p2pkv.worker.STREAM_IDLE_WAIT_S, 20 ms)",
    "stream_poll_interval_s": "a stream wait is polled from 1 ms, a constant "
                              "(p2pkv.decode.transfer.STREAM_POLL_MIN_S)",
    "stream_min_link_share": "the link rule's share is a constant 0.1 "
                             "(p2pkv.prefill.stream_measures.MIN_LINK_SHARE); stream_min_tokens 0 turns it off",
    "max_peers": "a decode worker keeps at most 256 prefill ranks, a constant (p2pkv.decode.keeper.MAX_PEERS)",
    "peer_idle_s": "a prefill rank unused for 600 s is dropped, a constant (p2pkv.decode.keeper.PEER_IDLE_S)",
    "otlp_traces_endpoint": "set OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or OTEL_EXPORTER_OTLP_ENDPOINT) in the "
                            "engine's environment instead",
    "push_max_in_flight": "a prefill rank posts at most 4 WRITEs at once per decode rank, a constant "
                          "(p2pkv.prefill.pusher.MAX_IN_FLIGHT)",
    "push_max_queued": "at most 256 WRITEs wait per decode rank, a constant (p2pkv.prefill.pusher.MAX_QUEUED)",
    "push_max_agents": "a prefill rank keeps at most 256 decode ranks loaded for push, a constant "
                       "(p2pkv.prefill.write_engine.MAX_AGENTS)",
    "push_agent_idle_s": "a decode rank with nothing to push is unloaded after 60 s, a constant "
                         "(p2pkv.prefill.write_engine.AGENT_IDLE_S)",
}
"""Settings p2pkv no longer has → what replaced each. Given one (a ``kv_connector_extra_config`` key or a
``P2PKV_<KEY>`` variable), :func:`load_config` refuses to start with a :class:`ConfigError` naming it and this."""


def _check_removed(extra_config: dict[str, Any], environ: dict[str, str]) -> None:
    """Refuse a removed setting (:data:`REMOVED`), in ``extra_config`` or as ``P2PKV_<KEY>`` in ``environ``.

    Raises:
        ConfigError: the first one found, naming it, where it came from and its replacement.
    """
    for key, replacement in REMOVED.items():
        variable = f"P2PKV_{key.upper()}"
        if key in extra_config:
            raise ConfigError(f"`{key}` was removed: {replacement}; remove the key from kv_connector_extra_config")
        if variable in environ:
            raise ConfigError(f"`{key}` was removed: {replacement}; unset {variable} in the environment")


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
        ConfigError: an unknown key, a removed one (:data:`REMOVED`, in either place), a value of the
            wrong type or out of range, or a non-empty ``secret`` in ``extra_config`` (vLLM prints the
            extra config in its log, and it is on the engine's command line);
            the message names the key.
    """
    environ = dict(os.environ) if environ is None else environ
    _check_removed(extra_config or {}, environ)
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
