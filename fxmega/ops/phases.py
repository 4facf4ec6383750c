"""Which phase of the step the ops traced now belong to.

The compiled step traces forward, loss and backward into one graph; torch's recompute pass
needs the backward marked as one region. Autograd's own backward nodes are; the backward
of a custom ``autograd.Function`` is not, unless it says so with ``backward_phase``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx.traceback


def backward_phase() -> Any:
    """Mark the nodes traced in this block as the step's backward region. Without it the
    backward of a custom autograd.Function (ZeRO-3's gather, cp's collectives, the chunked
    loss) is not tagged as backward, the backward splits into disjoint regions, and the
    recompute pass refuses the graph."""
    annotate = getattr(torch.fx.traceback, "annotate", None)
    return annotate({"phase": "backward"}) if annotate is not None else contextlib.nullcontext()
