"""Which UCX transport moves a peer's bytes, read off UCX's own protocol selection.

UCX picks a protocol (and the transports under it) per kind of operation the
first time a worker performs it: for a NIXL READ a ``ucp_get`` into this
agent's memory type, for a NIXL WRITE a ``ucp_put`` from it, over the
endpoint configuration of that peer. UCX makes that choice visible only
through its protocol-info output: with ``PROTO_INFO`` set to a glob it writes,
with ``PROTO_INFO_DIR`` set, one Graphviz file per message-size range into
that directory, named after the endpoint configuration and the operation,
e.g.::

    <agent>_intra_node_cfg_1_get_multi_into_host_memory_from_host_8157_inf.dot
    <agent>_intra_node_cfg_1_put_multi_from_host_memory_to_host_8173_inf.dot

whose first node is labelled with the selection's row, ``"zero-copy\\ncma/memory"``.
NIXL exposes no UCX endpoint, worker or protocol query, so these files are
the only faithful in-process source: :class:`TransportWatch` asks the NIXL
UCX backend for them per agent (its ``engine_config`` parameter:
``PROTO_INFO=[gp][eu]t*,PROTO_INFO_DIR=<private temporary directory>``; NIXL
leaves any of the two alone that the environment sets as ``UCX_...``),
diffs the directory around the first READ from and the first WRITE to each
peer, and reports the transport of the largest-message range (where the
bytes of KV blocks go).

Why that glob (UCX ``src/ucp/proto/proto_debug.c``, the same from 1.18 to
master; checked against the bundled UCX 1.23.0 by ``tests/test_transport.py``):
UCX matches ``PROTO_INFO`` with ``fnmatch`` twice. Before writing the files it
matches the operation's short form, ``"get(multi) into host memory from
host"`` / ``"put(multi) from host memory to host"`` (``ucp_operation_names``);
before printing the selection as a table (about 8 lines) on its log stream,
stdout unless the process-wide ``UCX_LOG_FILE``, it matches the long form,
``"remote memory read by ucp_get*(multi) into ..."`` (``ucp_operation_descs``).
``[gp][eu]t*`` is anchored at the start, so it matches the short form of
``get`` and ``put`` only: the files are written and nothing is printed. (A
``LOG_FILE`` entry in ``engine_config`` does nothing: UCX reads its log file
once per process, not per context.) The one line per peer this module logs
replaces the table.

Limits: two peers whose first xfers overlap may both be credited with the
union of their new selections; a peer that reuses an endpoint configuration
seen before (no new file) is credited with the transports already selected
for that operation and memory type; a ``UCX_PROTO_INFO`` in the environment
wins (``n``, or a glob that matches neither form: nothing is written and the
transport is reported as ``unknown``; one that matches the long form, like
``*get*``: UCX prints its tables again). Files are removed once read while
no other first xfer is in flight (one whose first xfer failed keeps them
until the agent closes; a few KiB per selection).
"""

from __future__ import annotations

import ctypes
import fnmatch
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger("p2pkv.dataplane.transport")

XferOp = Literal["READ", "WRITE"]
"""A NIXL xfer's direction, as :mod:`p2pkv.dataplane.agent` names it."""

PROTO_GLOB = "[gp][eu]t*"
"""UCX ``PROTO_INFO`` glob: write the selection files of ``ucp_get`` (NIXL READ) and ``ucp_put`` (NIXL WRITE),
print no table (see the module docstring)."""

UCX_OPS: dict[str, str] = {"READ": "get", "WRITE": "put"}
"""NIXL xfer → the UCX operation it posts."""

_SHORT_FORM = {"READ": "get(multi) into host memory from host", "WRITE": "put(multi) from host memory to host"}
"""What UCX matches ``PROTO_INFO`` against before writing a selection file (an example of each)."""

ZERO_COPY_TRANSPORTS = frozenset({
    "cma", "knem", "xpmem",  # shared memory: the kernel or a mapping copies straight between the two buffers
    "cuda_ipc", "rocm_ipc",  # GPU peer access between processes on one node
    "rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "rc_gda", "gga_mlx5", "srd",  # RDMA (verbs, EFA)
})
"""UCX transport names (UCT's, as ``ucx_info -d`` lists them and as selection rows name them, ``cma/memory``)
that move bytes between the two registered buffers without staging. Not in it: ``tcp`` (sockets),
``cuda_copy`` / ``rocm_cpy`` / ``gdr_copy`` (a copy between GPU and host: GPU memory staged through host
memory), ``posix`` / ``sysv`` (copies through a shared segment), ``self``."""

_DIRECT_PROTOCOLS = ("zero-copy", "mapped remote memory")
"""UCX protocol descriptions (``UCP_PROTO_ZCOPY_DESC``; the rkey_ptr protocols' "copy from/to mapped remote
memory") that touch no intermediate buffer; "copy-in", "copy-out", "software emulation", "rndv" do."""

VRAM_OVER_TCP_FIX = (
    "on one node let UCX use cuda_ipc for READs: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on (UCX turns cuda_ipc GET "
    "off where it finds no NVLink) and run both engines in one PID namespace (containers: --pid=host or "
    "hostPID: true; cuda_ipc needs to see the peer process); across nodes expose the RDMA NIC to UCX "
    "(rdma/ib device, IPC_LOCK, UCX_TLS/UCX_NET_DEVICES not excluding it); `p2pkv doctor` checks a GPU pair"
)
"""What to do when GPU memory is READ over TCP (named in the warning and by ``p2pkv doctor``)."""

VRAM_WRITE_OVER_TCP_FIX = (
    "on one node let UCX use cuda_ipc (UCX_TLS not excluding it) and run both engines in one PID namespace "
    "(containers: --pid=host or hostPID: true; cuda_ipc needs to see the peer process); across nodes expose "
    "the RDMA NIC to UCX (rdma/ib device, IPC_LOCK, UCX_TLS/UCX_NET_DEVICES not excluding it); `p2pkv doctor` "
    "checks a GPU pair"
)
"""What to do when GPU memory is WRITTEN over TCP (UCX's cuda_ipc PUT needs no NVLink, unlike its GET)."""

_FILE = re.compile(r"_(self|intra_node|inter_node)_cfg_(\d+)_((?:get|put)\w*?)_(?:into|from)_(\w+?)_(?:from|to)_"
                   r"(\w+)_([^_]+)_([^_]+)\.dot$")
_NODE0 = re.compile(r'node0 \[label="((?:[^"\\]|\\[^n])*)\\n([^"]*)"')
_TL = re.compile(r"([A-Za-z][A-Za-z0-9_]*)/")
_MEM_TYPES = ("cuda_managed", "rocm_managed", "ze_host", "ze_device", "ze_managed", "host", "cuda", "rocm", "rdma")
"""UCX memory type names (``ucs_memory_type_names``) as file names spell them, longest first."""
UCX_NAME_MAX = 31
"""Characters of a UCX context name UCX keeps (``UCP_ENTITY_NAME_MAX`` is 32 with the NUL)."""
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

_warned_vram_tcp: set[str] = set()
"""Ops (``READ`` / ``WRITE``) whose GPU-memory-over-TCP warning this process logged."""
_warn_lock = threading.Lock()


def _size(text: str) -> float:
    """``"8157"`` / ``"64K"`` / ``"inf"`` → bytes (``inf`` as float infinity; unparsable: -1)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]?)", text)
    if text == "inf":
        return float("inf")
    if not m or m.group(2).lower() not in _UNITS:
        return -1.0
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def _mem_type(part: str) -> str:
    """``"host_memory"`` / ``"cuda_GPU0"`` / ``"cuda_dev_2"`` (file-name form) → ``"host"`` / ``"cuda"``."""
    part = part.removesuffix("_memory")
    return next((m for m in _MEM_TYPES if part == m or part.startswith(m + "_")), part.split("_")[0])


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
    """One UCX protocol selection for a READ (``ucp_get``) or WRITE (``ucp_put``) on one endpoint configuration.

    Attributes:
        node: ``"self"``, ``"intra-node"`` or ``"inter-node"`` (UCX's endpoint kind).
        cfg: UCX endpoint configuration index.
        op: the operation as UCX names it (file-name form), e.g. ``"get_multi"``, ``"put_multi"``.
        local_mem / remote_mem: UCX memory types of this agent's and the peer's buffer (``"host"``, ``"cuda"``...).
        rows: the table, smallest messages first.
    """

    node: str
    cfg: int
    op: str
    local_mem: str
    remote_mem: str
    rows: tuple[ProtoRow, ...]

    @property
    def xfer_op(self) -> XferOp:
        """``"READ"`` for a ``get``, ``"WRITE"`` for a ``put``."""
        return "READ" if self.op.startswith("get") else "WRITE"

    def describe(self) -> str:
        """``"intra-node cfg#1 get_multi into host from host"`` / ``"... put_multi from host to host"``: UCX's words."""
        into, other = ("into", "from") if self.xfer_op == "READ" else ("from", "to")
        return f"{self.node} cfg#{self.cfg} {self.op} {into} {self.local_mem} {other} {self.remote_mem}"


def parse_selections(files: dict[str, str]) -> list[Selection]:
    """Group UCX ``PROTO_INFO_DIR`` files into selections.

    Args:
        files: file name → contents (Graphviz text); names that are not get or
            put selections are ignored.

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
        node, cfg, op, local, remote, start, end = m.groups()
        key = (node.replace("_", "-"), int(cfg), op, _mem_type(local), _mem_type(remote))
        groups.setdefault(key, []).append(ProtoRow(start, end, label.group(1).replace("\\n", " "), label.group(2)))
    return [Selection(*key, tuple(sorted(rows, key=lambda r: _size(r.start)))) for key, rows in sorted(groups.items())]


@dataclass(frozen=True)
class TransportReport:
    """Which UCX transport moves the bytes of READs from, or WRITEs to, one peer.

    Attributes:
        peer: remote agent name.
        mem_type: this agent's NIXL memory type (``"DRAM"`` / ``"VRAM"``).
        transport: UCX transport(s) of the largest-message range, ``+``-joined
            (``"cma"``, ``"tcp"``, ``"cuda_ipc"``, ``"rc_mlx5"``...), or
            ``"unknown"`` when UCX reported no selection.
        node: UCX's endpoint kind (``"intra-node"``...), ``""`` when unknown.
        detail: every selection's rows, or why the transport is unknown.
        op: ``"READ"`` (this agent pulls from ``peer``) or ``"WRITE"`` (it pushes to ``peer``).
        protocol: UCX's description of the largest-message range, ``+``-joined
            (``"zero-copy"``, ``"copy-in"``...; ``""`` when unknown).
    """

    peer: str
    mem_type: str
    transport: str
    node: str
    detail: str
    op: XferOp = "READ"
    protocol: str = ""

    @property
    def vram_over_tcp(self) -> bool:
        """GPU memory moved by TCP (the slow fallback worth a warning)."""
        return self.mem_type == "VRAM" and "tcp" in self.transport.split("+")


def is_zero_copy(report: TransportReport) -> bool:
    """Whether UCX moves the report's large messages straight between the two buffers (either op).

    True when every transport of the largest-message range is in
    :data:`ZERO_COPY_TRANSPORTS` (UCX transport names: ``cma``, ``knem``,
    ``xpmem``, ``cuda_ipc``, ``rocm_ipc``, RDMA ``rc_mlx5`` / ``dc_mlx5`` /
    ``rc_verbs`` / ``ud_mlx5`` ...) and every protocol UCX describes for it
    is direct (``"zero-copy"``; a report without a protocol is judged by its
    transports). False for ``tcp``, for GPU memory staged through host memory
    (``cuda_copy`` lanes, or a copy-in / copy-out / emulated protocol) and
    for ``unknown``.
    """
    tls = report.transport.split("+")
    if report.transport == "unknown" or not set(tls) <= ZERO_COPY_TRANSPORTS:
        return False
    return not report.protocol or all(any(d in p for d in _DIRECT_PROTOCOLS) for p in report.protocol.split("+"))


def read_is_zero_copy(report: TransportReport) -> bool:
    """Whether a peer's READs are zero-copy (:func:`is_zero_copy`); False for a WRITE's report, which says
    nothing about READs, and for ``unknown`` (callers that pull until UCX knows check ``transport`` first)."""
    return report.op == "READ" and is_zero_copy(report)


def merged_rows(rows: tuple[ProtoRow, ...]) -> list[ProtoRow]:
    """Adjacent rows with the same protocol and lanes merged into one range."""
    out: list[ProtoRow] = []
    for r in rows:
        if out and (out[-1].protocol, out[-1].config) == (r.protocol, r.config):
            out[-1] = ProtoRow(out[-1].start, r.end, r.protocol, r.config)
        else:
            out.append(r)
    return out


def summarize(peer: str, mem_type: str, selections: list[Selection], why_none: str,
              op: XferOp = "READ") -> TransportReport:
    """A :class:`TransportReport` from the selections UCX made for ``peer``'s ``op`` xfers.

    The transport is that of the largest-message row (KV blocks are large
    descriptors), over every selection given.
    """
    if not selections:
        return TransportReport(peer, mem_type, "unknown", "", why_none, op)
    big = {t for s in selections for t in s.rows[-1].transports}
    protocols = sorted({s.rows[-1].protocol for s in selections})
    detail = "; ".join(f"{s.describe()}: " + ", ".join(f"{r.start}..{r.end} {r.protocol} {r.config}"
                                                       for r in merged_rows(s.rows))
                       for s in selections)
    nodes = sorted({s.node for s in selections})
    return TransportReport(peer, mem_type, "+".join(sorted(big)) or "unknown", "+".join(nodes), detail, op,
                           "+".join(protocols))


def _sanitized(name: str) -> str:
    """An agent name as UCX writes it in file names (runs of other characters → ``_``)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name)


def _unknown_reason(env: dict[str, str] | os._Environ, user_dir: str, op: XferOp) -> str:
    """Why UCX may have written no selection file for ``op`` (the environment's settings first)."""
    info = env.get("UCX_PROTO_INFO", "").strip()
    if info.lower() in ("n", "no", "off", "0", "false"):
        return f"UCX_PROTO_INFO={info} turns UCX's protocol report off"
    if "%" in user_dir:
        return f"UCX_PROTO_INFO_DIR={user_dir} is a template p2pkv cannot resolve"
    if info and info.lower() not in ("y", "yes", "on", "1", "true") and not fnmatch.fnmatchcase(
            _SHORT_FORM[op], info.lower()):
        return f"UCX_PROTO_INFO={info} (environment) does not match UCX's {UCX_OPS[op]} selections"
    return f"UCX reported no protocol selection for {op}s"


class TransportWatch:
    """Learns, per peer, the UCX transport of its READs and of WRITEs to it (see the module docstring).

    Args:
        agent_name: this NIXL agent's name (UCX's context name, the prefix of its files).
        environ: environment to honour (``UCX_PROTO_INFO``, ``UCX_PROTO_INFO_DIR``); ``os.environ`` by default.

    Thread safety: :meth:`before_xfer` and :meth:`after_xfer` may be called
    from several threads.
    """

    def __init__(self, agent_name: str, environ: dict[str, str] | None = None) -> None:
        self.auto_push = False
        """This agent's READs are pushed instead where they are not zero-copy (``transfer_mode: auto``): slow
        READs of GPU memory are then told at INFO (:func:`warn_vram_over_tcp`). Set by the agent's owner."""
        env = os.environ if environ is None else environ
        user_dir = env.get("UCX_PROTO_INFO_DIR", "")
        self._own = not user_dir
        self.dir = Path(user_dir) if user_dir else Path(tempfile.mkdtemp(prefix="p2pkv-ucx-proto-"))
        self._name = agent_name
        # UCX names the context after the agent, cut to UCP_ENTITY_NAME_MAX - 1 characters; a
        # private directory holds this agent's files only, a user's may hold other processes' too.
        self._prefix = "" if self._own else _sanitized(agent_name[:UCX_NAME_MAX]) + "_"
        self._why_none = {op: _unknown_reason(env, user_dir, op) for op in UCX_OPS}
        self._lock = threading.Lock()
        self._before: dict[tuple[str, str], set[str]] = {}  # (op, peer) → listing before its first xfer
        self._seen: list[Selection] = []
        if self._own:
            weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.reports: dict[str, TransportReport] = {}
        """Peer name → the report of its READs, once its first READ finished."""
        self.write_reports: dict[str, TransportReport] = {}
        """Peer name → the report of WRITEs to it, once the first one finished."""

    def engine_config(self) -> str:
        """The NIXL UCX backend ``engine_config`` value that turns UCX's get/put selection files on."""
        return f"PROTO_INFO={PROTO_GLOB},PROTO_INFO_DIR={self.dir}" if self._own else f"PROTO_INFO={PROTO_GLOB}"

    def reports_of(self, op: XferOp) -> dict[str, TransportReport]:
        """:attr:`reports` for ``"READ"``, :attr:`write_reports` for ``"WRITE"``."""
        return self.reports if op == "READ" else self.write_reports

    def _listing(self) -> set[str]:
        try:
            return {p.name for p in self.dir.iterdir() if p.name.startswith(self._prefix)}
        except OSError:
            return set()

    def before_xfer(self, peer: str, op: XferOp) -> None:
        """Call before posting an ``op`` xfer with ``peer``; remembers the files of the first one."""
        with self._lock:
            if peer not in self.reports_of(op) and (op, peer) not in self._before:
                self._before[(op, peer)] = self._listing()

    def after_xfer(self, peer: str, mem_type: str, op: XferOp) -> TransportReport | None:
        """Call when an ``op`` xfer with ``peer`` is done; the report the first time, else None.

        Logs the transport (INFO, one line) and, the first time in this
        process that GPU memory goes over TCP for ``op``, a WARNING naming the fix.
        """
        with self._lock:
            before = self._before.pop((op, peer), None)
            if before is None or peer in self.reports_of(op):
                return None
            now = self._listing()
            new = self._read(now - before)
            if self._own and not self._before:  # read once, remembered below; no other xfer's window is open
                for name in now:
                    (self.dir / name).unlink(missing_ok=True)
            self._seen.extend(new)
            selections = self._relevant(new, peer, mem_type, op)
            if not selections:  # an endpoint configuration an earlier peer made UCX select for already
                selections = self._relevant(self._seen, peer, mem_type, op)
            report = summarize(peer, mem_type, selections, self._why_none[op], op)
            self.reports_of(op)[peer] = report
        zero_copy = "zero-copy" if is_zero_copy(report) else "not zero-copy"
        if op == "READ":
            logger.info("p2pkv: READs from %s into %s move over UCX %s (%s, %s; UCX's selection: %s)", peer,
                        mem_type, report.transport, report.node or "endpoint kind unknown", zero_copy, report.detail)
        else:
            logger.info("p2pkv: WRITEs to %s from %s move over UCX %s (%s, %s; UCX's selection: %s)", peer,
                        mem_type, report.transport, report.node or "endpoint kind unknown", zero_copy, report.detail)
        if report.vram_over_tcp:
            warn_vram_over_tcp(report, pushed_instead=self.auto_push)
        return report

    def _relevant(self, selections: list[Selection], peer: str, mem_type: str, op: XferOp) -> list[Selection]:
        """The selections of ``op`` for this memory type, without UCX's own-worker (``self``) endpoint
        unless ``peer`` is this agent (UCX selects a ``put`` on it when NIXL connects)."""
        host = mem_type == "DRAM"
        return [s for s in selections if s.xfer_op == op and (s.local_mem == "host") == host
                and (s.node != "self" or peer == self._name)]

    def _read(self, names: set[str]) -> list[Selection]:
        files = {}
        for name in names:
            try:
                files[name] = (self.dir / name).read_text(errors="replace")
            except OSError:
                continue
        return parse_selections(files)

    def forget(self, peer: str) -> None:
        """Drop what was learned of ``peer`` (its agent left NIXL): its next first READ or WRITE reports again,
        and the tables stay as large as the peers loaded, not as all the agent names ever seen."""
        with self._lock:
            self.reports.pop(peer, None)
            self.write_reports.pop(peer, None)
            for op in UCX_OPS:
                self._before.pop((op, peer), None)

    def close(self) -> None:
        """Remove the private directory (a user's ``UCX_PROTO_INFO_DIR`` stays). Idempotent."""
        if self._own:
            shutil.rmtree(self.dir, ignore_errors=True)


def vram_over_tcp_fix(op: XferOp) -> str:
    """:data:`VRAM_OVER_TCP_FIX` for READs, :data:`VRAM_WRITE_OVER_TCP_FIX` for WRITEs."""
    return VRAM_OVER_TCP_FIX if op == "READ" else VRAM_WRITE_OVER_TCP_FIX


def warn_vram_over_tcp(report: TransportReport, pushed_instead: bool = False) -> bool:
    """Log the GPU-memory-over-TCP warning once per process and op; True if this call logged it.

    ``pushed_instead``: READs under ``transfer_mode: auto``, which has the prefill rank WRITE where READs are not
    zero-copy; then it is an INFO line saying so, naming what would make READs fast too.
    """
    with _warn_lock:
        if report.op in _warned_vram_tcp:
            return False
        _warned_vram_tcp.add(report.op)
    what = f"READs from {report.peer}" if report.op == "READ" else f"WRITEs to {report.peer}"
    if pushed_instead and report.op == "READ":
        logger.info("p2pkv: GPU memory (VRAM) %s go over TCP (UCX selected %s); transfer_mode auto has the "
                    "prefill rank WRITE instead. To READ at device speed too: %s", what, report.detail,
                    vram_over_tcp_fix(report.op))
        return True
    logger.warning("p2pkv: GPU memory (VRAM) %s go over TCP (UCX selected %s): expect about 0.5 GB/s instead of "
                   "device speed. Fix: %s", what, report.detail, vram_over_tcp_fix(report.op))
    return True


def ucx_version() -> str | None:
    """The version string of the UCX library (``libucp``) bundled with the installed NIXL wheel, or None when
    no wheel's library answers (``ucp_get_version_string``)."""
    for mod in ("nixl_cu13", "nixl_cu12", "nixl"):
        spec = importlib.util.find_spec(mod)
        if spec is None or spec.origin is None:
            continue
        libs = Path(spec.origin).parent.parent / f"{mod}.libs"
        for lib in sorted(libs.glob("libucp*.so*")):
            try:
                fn = ctypes.CDLL(str(lib)).ucp_get_version_string
                fn.restype = ctypes.c_char_p
                return fn().decode()
            except (OSError, AttributeError):
                continue
    return None
