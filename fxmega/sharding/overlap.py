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

Async tensor parallelism (``parallel.async_tp``) is inductor's micro-pipeline TP pass: each
sequence-parallel all-gather feeding a matmul, and each matmul feeding a reduce-scatter, is
rewritten into chunks exchanged through CUDA symmetric memory while the other chunks
multiply (torchtitan's ``enable_async_tensor_parallel``, Megatron's ``--tp-comm-overlap``).
It needs CUDA and a tp axis (``training.run.check_compute`` refuses it elsewhere); since
torch 2.10 symmetric memory needs no per-group enabling.
"""

from __future__ import annotations

from typing import Protocol

PASSES = ["sink_waits", "raise_comms"]


class OverlapSettings(Protocol):
    overlap_comm: bool
    async_tp: bool


def inductor_options(parallel: OverlapSettings) -> dict:
    """The inductor settings for ``parallel.overlap_comm`` (reordering) and
    ``parallel.async_tp`` (micro-pipelined tensor parallelism)."""
    options: dict = {}
    if parallel.overlap_comm:
        options |= {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": list(PASSES)}
    if parallel.async_tp:
        options["_micro_pipeline_tp"] = True
    return options
