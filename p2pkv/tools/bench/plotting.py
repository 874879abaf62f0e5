"""Matplotlib for the ``p2pkv bench`` plots: loading it headless, and writing a figure as a PNG.

matplotlib is optional (the ``p2pkv[bench]`` extra): :func:`pyplot` imports
it only when a plot is asked for, on the non-interactive Agg backend, and
says on stderr when it is missing. :func:`save` writes every bench's figure
the same way (:data:`DPI` dots per inch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

DPI = 110
"""Resolution of the PNGs (dots per inch)."""


def pyplot(prog: str, what: str = "plot") -> Any | None:
    """``matplotlib.pyplot`` on the Agg backend, or None without matplotlib.

    Args:
        prog: who is asking, for the message (e.g. ``"p2pkv bench serve"``).
        what: what will not be drawn, for the message (e.g. ``"handover plot"``).

    Returns:
        The ``matplotlib.pyplot`` module; None after writing
        ``<prog>: matplotlib is not installed (pip install 'p2pkv[bench]'); no <what>`` to stderr.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{prog}: matplotlib is not installed (pip install 'p2pkv[bench]'); no {what}", file=sys.stderr)
        return None
    return plt


def save(fig: Any, path: str | os.PathLike[str], dpi: int = DPI) -> None:
    """Write the figure ``fig`` to ``path`` (PNG at ``dpi`` dots per inch; creates the folder) and close it."""
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
