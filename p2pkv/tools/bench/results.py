"""What every bench writes: timing statistics and the JSON results file.

Used by ``p2pkv bench serve`` and the ``scripts/bench_*.py`` microbenchmarks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def summarize(xs: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50 / p90 / p99 / mean / min / max of ``xs`` times ``scale`` (e.g. 1e3: seconds → ms).

    Percentiles interpolate linearly between samples (numpy's default), so
    with few samples p99 is close to the max.

    Raises:
        ValueError: ``xs`` is empty.
    """
    import numpy as np

    a = np.asarray(xs, dtype=np.float64) * scale
    if a.size == 0:
        raise ValueError("summarize: no samples")
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}



def median_interval(xs: Sequence[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median of ``xs``: the 2.5th and 97.5th percentiles of the medians of
    ``resamples`` resamples drawn with replacement (seeded: the same ``xs`` give the same interval). The
    percentile method: Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), ch. 13.

    Raises:
        ValueError: ``xs`` is empty or ``resamples`` < 40.
    """
    import random
    import statistics

    if not xs or resamples < 40:
        raise ValueError(f"median_interval: need samples and at least 40 resamples, not {len(xs)} / {resamples}")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def pairs_needed(sd_log: float, margin: float, z: float = 1.96) -> int:
    """Pairs a paired comparison needs for the interval of its mean ratio to reach ``margin`` either side: the
    smallest ``n`` with ``z · sd_log / √n ≤ ln(1 + margin)`` (normal approximation; ``sd_log``: the standard
    deviation of one pair's ``ln(b / a)``; ``z`` 1.96: a 95 % interval).

    Raises:
        ValueError: ``sd_log`` < 0 or ``margin`` ≤ 0.
    """
    import math

    if sd_log < 0 or margin <= 0:
        raise ValueError(f"pairs_needed: sd_log must be >= 0 and margin > 0, not {sd_log} / {margin}")
    return max(1, math.ceil((z * sd_log / math.log1p(margin)) ** 2))


def write_json(result: dict[str, Any], path: str | os.PathLike[str], indent: int = 2) -> None:
    """Write the results as JSON indented by ``indent`` spaces, one newline at the end (creates the parent
    folder)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=indent, sort_keys=False) + "\n", encoding="utf-8")
