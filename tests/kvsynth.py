"""Synthetic KV caches shaped like vLLM's, for transfer tests (now in :mod:`p2pkv.bench.synth`)."""

from __future__ import annotations

from p2pkv.bench.synth import LAYOUTS, block_bytes, make_kv_caches

__all__ = ["LAYOUTS", "block_bytes", "make_kv_caches"]
