"""matplotlib for the evaluation plots (frontier, streaming curve, needle heatmap, decode latency).

matplotlib is an optional extra (``minillama[bench]``); every ``--plot`` goes through here so a
missing install is one clear error, and the non-interactive Agg backend is chosen once.
"""

from __future__ import annotations

from minillama.errors import UserError


def pyplot():
    """matplotlib.pyplot with the Agg backend, or a UserError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'minillama[bench]'") from None
    return plt
