"""The modules of ``scripts/bench_transfer.py`` (KV transfer over NIXL between two processes vs memcpy).

* :mod:`transfer_bench.options`: the options, their flags, the names both processes share;
* :mod:`transfer_bench.prefill`: the spawned prefill process and the decode process's handle on it;
* :mod:`transfer_bench.decode`: the decode side's caches, NIXL agent and ways to pull;
* :mod:`transfer_bench.push`: the push direction (the prefill side WRITEs);
* :mod:`transfer_bench.report`: per-method statistics, the table, the JSON file and the plot.
"""
