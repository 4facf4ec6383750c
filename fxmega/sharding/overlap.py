"""Communication hidden behind compute, by inductor's own scheduling passes.

In the traced step a collective sits where tracing met it: a gradient bucket's reduction
after the whole backward, its wait right after it. Inductor's ``reorder_for_compute_comm_
overlap`` passes move each collective up to where its inputs are ready (``raise_comms``:
a bucket's reduction right after its last gradient, while the backward of earlier layers
still runs) and each wait down to just before the first use of its result
(``sink_waits``). That is Megatron's ``--overlap-grad-reduce`` / ``--overlap-param-gather``
done by the compiler on the whole graph: ZeRO's gathers and reduce-scatters, tp's and the
data axes' collectives alike. No pass of fxmega's own is needed: with them on, every
gradient reduction of the tiny GPT on dp=2 has compute before its wait
(``collectives.kernels_before_waits``; tests/test_overlap.py).
"""

from __future__ import annotations

PASSES = ["sink_waits", "raise_comms"]


def inductor_options() -> dict:
    """The inductor settings that turn the reordering on (``parallel.overlap_comm``)."""
    return {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": list(PASSES)}
