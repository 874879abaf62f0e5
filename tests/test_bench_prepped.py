"""``p2pkv bench prepped``: both ways of building a READ move the right bytes; row counts as planned."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")

from p2pkv.tools.bench.prepped import run


@pytest.mark.parametrize(("stride", "rows_per_segment"), [(1, 1), (2, 4)])
def test_both_cases_pull_exact_bytes(stride: int, rows_per_segment: int) -> None:
    result = run(segments=3, blocks=16, block_bytes=256, pull_blocks=4, stride=stride, repeats=3)
    assert set(result["cases"]) == {"init_rows", "prepped"}
    assert result["cases"]["init_rows"]["descriptors"] == 3 * rows_per_segment
    assert result["cases"]["prepped"]["descriptors"] == 3 * 4
    for case in result["cases"].values():
        assert case["build_us"]["p50"] > 0 and case["post_us"]["p50"] > 0


def test_a_pull_past_the_last_block_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds --blocks 8"):
        run(segments=1, blocks=8, block_bytes=256, pull_blocks=5, stride=2, repeats=1)
