"""Benchmarks of p2pkv's KV transfer path (``p2pkv bench ...``).

* :mod:`p2pkv.tools.bench.serve`: ``p2pkv bench serve``, a serving benchmark of a
  p2pkv pair, a NixlConnector pair and one engine through the proxy.

Synthetic KV caches and block placements come from :mod:`p2pkv.testing`.
Shared by the benches: :mod:`p2pkv.tools.bench.table` (text tables and their
cells), :mod:`p2pkv.tools.bench.plotting` (matplotlib, headless, and PNG
files), :mod:`p2pkv.tools.bench.machine` (the command line, host, device and
versions a result records). The ``p2pkv bench`` subcommands are listed in
:data:`p2pkv.tools.cli.BENCHES`.

The microbenchmarks are scripts of the checkout, as vLLM keeps its kernel
benchmarks outside its package: the KV transfer between two processes by
``scripts/bench_transfer.py`` (its modules in ``scripts/transfer_bench/``),
the post-receive fixup's kernels by ``scripts/bench_fixup.py``, and the
scheduler hooks by ``scripts/bench_scheduler_hooks.py``; they use the
helpers here. Nothing here is imported by the connector itself.
"""

from __future__ import annotations
