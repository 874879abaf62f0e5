"""Which UCX transport moves a peer's bytes, read off UCX's own protocol selection.

UCX picks a protocol (and the transports under it) per kind of operation the
first time a worker performs it: for a NIXL READ, a ``ucp_get`` into this
agent's memory type over the endpoint configuration of that peer. UCX makes
that choice visible only through its protocol-info output: with
``PROTO_INFO`` set to a glob of operations it prints each selection as a
table on its log stream (stdout unless ``UCX_LOG_FILE``), and with
``PROTO_INFO_DIR`` it also writes one Graphviz file per message-size range
into that directory, named after the endpoint configuration and the
operation, e.g.::

    <agent>_intra_node_cfg_1_get_multi_into_host_memory_from_host_8157_inf.dot

whose first node is labelled with the table's row, ``"zero-copy\\ncma/memory"``.
NIXL exposes no UCX endpoint, worker or protocol query, so these files are
the only faithful in-process source: :class:`TransportWatch` asks the NIXL
UCX backend for them per agent (its ``engine_config`` parameter:
``PROTO_INFO=*get*,PROTO_INFO_DIR=<private temporary directory>``; NIXL
leaves any of the two alone that the environment sets as ``UCX_...``),
diffs the directory around the first READ from each peer, and reports the
transport of the largest-message range (where the bytes of KV pulls go).

Limits: UCX also prints each READ selection's table (a few lines) on its log
stream; two peers whose first READs overlap may both be credited with the
union of their new selections; a peer that reuses an endpoint configuration
seen before (no new file) is credited with the transports already selected
for that memory type; with ``UCX_PROTO_INFO=n`` (or a glob that excludes
``get``) in the environment nothing is written and the transport is
reported as ``unknown``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("p2pkv.dataplane.transport")

PROTO_GLOB = "*get*"
"""UCX ``PROTO_INFO`` glob: report the selections of ``ucp_get`` (NIXL READ) only."""

VRAM_OVER_TCP_FIX = (
    "on one node let UCX use cuda_ipc for READs: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on (UCX turns cuda_ipc GET "
    "off where it finds no NVLink) and run both engines in one PID namespace (containers: --pid=host or "
    "hostPID: true; cuda_ipc needs to see the peer process); across nodes expose the RDMA NIC to UCX "
    "(rdma/ib device, IPC_LOCK, UCX_TLS/UCX_NET_DEVICES not excluding it); `p2pkv doctor` checks a GPU pair"
)
"""What to do when GPU memory is READ over TCP (named in the warning and by ``p2pkv doctor``)."""

_FILE = re.compile(r"_(self|intra_node|inter_node)_cfg_(\d+)_(get\w*?)_into_(\w+?)_memory_from_(\w+?)"
                   r"_([0-9A-Za-z.]+)_([0-9A-Za-z.]+)\.dot$")
_NODE0 = re.compile(r'node0 \[label="((?:[^"\\]|\\[^n])*)\\n([^"]*)"')
_TL = re.compile(r"([A-Za-z][A-Za-z0-9_]*)/")
UCX_NAME_MAX = 31
"""Characters of a UCX context name UCX keeps (``UCP_ENTITY_NAME_MAX`` is 32 with the NUL)."""
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

_warned_vram_tcp = False
_warn_lock = threading.Lock()


def _size(text: str) -> float:
    """``"8157"`` / ``"64K"`` / ``"inf"`` → bytes (``inf`` as float infinity; unparsable: -1)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]?)", text)
    if text == "inf":
        return float("inf")
    if not m or m.group(2).lower() not in _UNITS:
        return -1.0
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass(frozen=True)
class ProtoRow:
    """One row of a UCX protocol selection table.

    Attributes:
        start / end: message sizes (bytes, as UCX writes them; ``end`` may be ``"inf"``).
        protocol: UCX's description, e.g. ``"zero-copy"``, ``"multi-frag copy-in"``.
        config: the lanes, e.g. ``"cma/memory"``, ``"tcp/lo"``, ``"rc_mlx5/mlx5_0:1"``.
    """

    start: str
    end: str
    protocol: str
    config: str

    @property
    def transports(self) -> tuple[str, ...]:
        """UCX transport names in :attr:`config` (``"cma"``, ``"tcp"``, ``"cuda_ipc"``...), sorted."""
        return tuple(sorted(set(_TL.findall(self.config))))


@dataclass(frozen=True)
class Selection:
    """One UCX protocol selection for a READ (``ucp_get``) on one endpoint configuration.

    Attributes:
        node: ``"self"``, ``"intra-node"`` or ``"inter-node"`` (UCX's endpoint kind).
        cfg: UCX endpoint configuration index.
        op: the operation as UCX names it (file-name form), e.g. ``"get_multi"``.
        into_mem / from_mem: UCX memory types, local and remote (``"host"``, ``"cuda"``...).
        rows: the table, smallest messages first.
    """

    node: str
    cfg: int
    op: str
    into_mem: str
    from_mem: str
    rows: tuple[ProtoRow, ...]


def parse_selections(files: dict[str, str]) -> list[Selection]:
    """Group UCX ``PROTO_INFO_DIR`` files into selections.

    Args:
        files: file name → contents (Graphviz text); names that are not READ
            selections are ignored.

    Returns:
        One :class:`Selection` per (endpoint kind, configuration, operation,
        memory types), rows sorted by message size.
    """
    groups: dict[tuple, list[ProtoRow]] = {}
    for name, text in files.items():
        m = _FILE.search(name)
        label = _NODE0.search(text)
        if not m or not label:
            continue
        node, cfg, op, into_mem, from_mem, start, end = m.groups()
        key = (node.replace("_", "-"), int(cfg), op, into_mem, from_mem)
        groups.setdefault(key, []).append(ProtoRow(start, end, label.group(1).replace("\\n", " "), label.group(2)))
    return [Selection(*key, tuple(sorted(rows, key=lambda r: _size(r.start)))) for key, rows in sorted(groups.items())]


@dataclass(frozen=True)
class TransportReport:
    """Which UCX transport moves the bytes of READs from one peer.

    Attributes:
        peer: remote agent name.
        mem_type: this agent's NIXL memory type (``"DRAM"`` / ``"VRAM"``).
        transport: UCX transport(s) of the largest-message range, ``+``-joined
            (``"cma"``, ``"tcp"``, ``"cuda_ipc"``, ``"rc_mlx5"``...), or
            ``"unknown"`` when UCX reported no selection.
        node: UCX's endpoint kind (``"intra-node"``...), ``""`` when unknown.
        detail: every selection's rows, or why the transport is unknown.
    """

    peer: str
    mem_type: str
    transport: str
    node: str
    detail: str

    @property
    def vram_over_tcp(self) -> bool:
        """GPU memory moved by TCP (the slow fallback worth a warning)."""
        return self.mem_type == "VRAM" and "tcp" in self.transport.split("+")


def merged_rows(rows: tuple[ProtoRow, ...]) -> list[ProtoRow]:
    """Adjacent rows with the same protocol and lanes merged into one range."""
    out: list[ProtoRow] = []
    for r in rows:
        if out and (out[-1].protocol, out[-1].config) == (r.protocol, r.config):
            out[-1] = ProtoRow(out[-1].start, r.end, r.protocol, r.config)
        else:
            out.append(r)
    return out


def summarize(peer: str, mem_type: str, selections: list[Selection], why_none: str) -> TransportReport:
    """A :class:`TransportReport` from the selections UCX made for ``peer``'s READs.

    The transport is that of the largest-message row (KV pulls move large
    descriptors), over every selection given.
    """
    if not selections:
        return TransportReport(peer, mem_type, "unknown", "", why_none)
    big = {t for s in selections for t in s.rows[-1].transports}
    detail = "; ".join(f"{s.node} cfg#{s.cfg} {s.op} into {s.into_mem} from {s.from_mem}: "
                       + ", ".join(f"{r.start}..{r.end} {r.protocol} {r.config}" for r in merged_rows(s.rows))
                       for s in selections)
    nodes = sorted({s.node for s in selections})
    return TransportReport(peer, mem_type, "+".join(sorted(big)) or "unknown", "+".join(nodes), detail)


def _sanitized(name: str) -> str:
    """An agent name as UCX writes it in file names (runs of other characters → ``_``)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name)


class TransportWatch:
    """Learns, per peer, the UCX transport of its READs (see the module docstring).

    Args:
        agent_name: this NIXL agent's name (UCX's context name, the prefix of its files).
        environ: environment to honour (``UCX_PROTO_INFO``, ``UCX_PROTO_INFO_DIR``); ``os.environ`` by default.

    Thread safety: :meth:`before_read` and :meth:`after_read` may be called
    from several threads.
    """

    def __init__(self, agent_name: str, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        user_dir = env.get("UCX_PROTO_INFO_DIR", "")
        self._own = not user_dir
        self.dir = Path(user_dir) if user_dir else Path(tempfile.mkdtemp(prefix="p2pkv-ucx-proto-"))
        # UCX names the context after the agent, cut to UCP_ENTITY_NAME_MAX - 1 characters; a
        # private directory holds this agent's files only, a user's may hold other processes' too.
        self._prefix = "" if self._own else _sanitized(agent_name[:UCX_NAME_MAX]) + "_"
        self._why_none = "UCX reported no protocol selection for READs"
        info = env.get("UCX_PROTO_INFO", "").strip().lower()
        if info in ("n", "no", "off", "0", "false"):
            self._why_none = f"UCX_PROTO_INFO={env['UCX_PROTO_INFO']} turns UCX's protocol report off"
        elif "%" in user_dir:
            self._why_none = f"UCX_PROTO_INFO_DIR={user_dir} is a template p2pkv cannot resolve"
        self._lock = threading.Lock()
        self._before: dict[str, set[str]] = {}
        self._seen: list[Selection] = []
        if self._own:
            weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.reports: dict[str, TransportReport] = {}
        """Peer name → its report, once its first READ finished."""

    def engine_config(self) -> str:
        """The NIXL UCX backend ``engine_config`` value that turns UCX's READ protocol report on."""
        return f"PROTO_INFO={PROTO_GLOB},PROTO_INFO_DIR={self.dir}" if self._own else f"PROTO_INFO={PROTO_GLOB}"

    def _listing(self) -> set[str]:
        try:
            return {p.name for p in self.dir.iterdir() if p.name.startswith(self._prefix)}
        except OSError:
            return set()

    def before_read(self, peer: str) -> None:
        """Call before posting a READ from ``peer``; remembers the files of its first one."""
        with self._lock:
            if peer not in self.reports and peer not in self._before:
                self._before[peer] = self._listing()

    def after_read(self, peer: str, mem_type: str) -> TransportReport | None:
        """Call when a READ from ``peer`` is done; the peer's report the first time, else None.

        Logs the transport (INFO) and, the first time in this process that GPU
        memory goes over TCP, a WARNING naming the fix.
        """
        with self._lock:
            before = self._before.pop(peer, None)
            if before is None or peer in self.reports:
                return None
            now = self._listing()
            selections = self._read(now - before)
            if self._own:  # read once; remembered below (a killed engine leaves an empty directory at most)
                for name in now:
                    (self.dir / name).unlink(missing_ok=True)
            self._seen.extend(selections)
            if not selections:  # an endpoint configuration an earlier peer made UCX select for already
                selections = [s for s in self._seen if (s.into_mem == "host") == (mem_type == "DRAM")]
            report = summarize(peer, mem_type, selections, self._why_none)
            self.reports[peer] = report
        logger.info("p2pkv: READs from %s into %s move over UCX %s (%s; UCX's selection: %s)", peer, mem_type,
                    report.transport, report.node or "endpoint kind unknown", report.detail)
        if report.vram_over_tcp:
            warn_vram_over_tcp(report)
        return report

    def _read(self, names: set[str]) -> list[Selection]:
        files = {}
        for name in names:
            try:
                files[name] = (self.dir / name).read_text(errors="replace")
            except OSError:
                continue
        return parse_selections(files)

    def close(self) -> None:
        """Remove the private directory (a user's ``UCX_PROTO_INFO_DIR`` stays). Idempotent."""
        if self._own:
            shutil.rmtree(self.dir, ignore_errors=True)


def warn_vram_over_tcp(report: TransportReport) -> bool:
    """Log the GPU-memory-over-TCP warning once per process; True if this call logged it."""
    global _warned_vram_tcp
    with _warn_lock:
        if _warned_vram_tcp:
            return False
        _warned_vram_tcp = True
    logger.warning("p2pkv: GPU memory (VRAM) READs from %s go over TCP (UCX selected %s): expect about 0.5 GB/s "
                   "instead of device speed. Fix: %s", report.peer, report.detail, VRAM_OVER_TCP_FIX)
    return True
