"""Benchmarks of p2pkv's KV transfer path (``p2pkv bench ...``).

* :mod:`p2pkv.tools.bench.transfer`: ``p2pkv bench transfer``, a two-process NIXL
  pull benchmark against an in-process memcpy of the same bytes.
* :mod:`p2pkv.tools.bench.report`: ``p2pkv bench transfer``'s table, plot and target
  checks; the JSON file of every bench.
* :mod:`p2pkv.tools.bench.serve`: ``p2pkv bench serve``, a serving benchmark of a
  p2pkv pair, a NixlConnector pair and one engine through the proxy.

Synthetic KV caches and block placements come from :mod:`p2pkv.testing`.
Shared by the benches: :mod:`p2pkv.tools.bench.table` (text tables and their
cells), :mod:`p2pkv.tools.bench.plotting` (matplotlib, headless, and PNG
files), :mod:`p2pkv.tools.bench.machine` (the command line, host, device and
versions a result records). The ``p2pkv bench`` subcommands are listed in
:data:`p2pkv.tools.cli.BENCHES`.

The post-receive fixup's kernels are measured by ``scripts/bench_fixup.py``,
and the scheduler hooks by ``scripts/bench_scheduler_hooks.py``. Nothing here
is imported by the connector itself.
"""

from __future__ import annotations
