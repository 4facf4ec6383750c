"""Communication hidden behind compute, by inductor's own scheduling passes.

In the traced step a collective sits where tracing met it: a gradient bucket's reduction
after the whole backward, its wait right after it. Inductor's ``reorder_for_compute_comm_
overlap`` passes move each collective up to where its inputs are ready (``raise_comms``:
a bucket's reduction right after its last gradient, while the backward of earlier layers
still runs) and each wait down to just before the first use of its result
(``sink_waits``). That is Megatron's ``--overlap-grad-reduce`` / ``--overlap-param-gather``
done by the compiler on the whole graph: ZeRO's gathers and reduce-scatters, tp's and the
data axes' collectives alike: with them on, the tiny GPT's gradient reductions on dp=2 have
compute before their waits (``generated_code.kernels_before_waits``; tests/test_overlap.py).
One pass is fxmega's own, ``bound_gather_prefetch``: it keeps all-gathers one piece ahead,
which ``raise_comms`` does not (see there).

Async tensor parallelism (``parallel.async_tp``) is inductor's micro-pipeline TP pass: each
sequence-parallel all-gather feeding a matmul, and each matmul feeding a reduce-scatter, is
rewritten into chunks exchanged through CUDA symmetric memory while the other chunks
multiply (torchtitan's ``enable_async_tensor_parallel``, Megatron's ``--tp-comm-overlap``).
It needs CUDA and a tp axis (``training.run.check_compute`` refuses it elsewhere); since
torch 2.10 symmetric memory needs no per-group enabling.
"""

from __future__ import annotations

from typing import Any, Protocol


def bound_gather_prefetch(snodes: list[Any]) -> list[Any]:
    """Inductor scheduler pass (after ``raise_comms``): each all-gather is issued no earlier
    than the first kernel that reads the previous all-gather's result — one piece ahead.

    ``raise_comms`` issues a collective as soon as its inputs exist; a ZeRO-3 gather's inputs
    are parameter shards, present when the step starts, so it issues most gathers at once
    and most pieces' full parameters are alive together (measured on the tiny GPT at dp=2:
    5 of 7 gathered pieces waiting for their first use at once). FSDP and Megatron prefetch
    one piece: the next gather starts when the current piece starts computing. torch's own
    bounded scheduler (``aten_distributed_optimizations``: ``max_in_flight_gb``,
    ``max_compute_pre_fetch``) does this but needs a GPU driver (on a CPU it stops with "0
    active drivers"), and the peak-memory-preserving passes kept all 7 in flight on the tiny
    model (whose peak is its activations), so this pass is fxmega's own.

    A gather moves down to just after the previous gather's first reader, what depends on it
    (its wait, the copies that unpack it) to just before their first reader; never past a
    node that needs it. Other collectives are left where the passes before put them."""
    order = list(snodes)
    previous_reader = None
    for gather in [n for n in order if _is_all_gather(n)]:
        if previous_reader is not None and order.index(gather) < order.index(previous_reader):
            _move_after(order, gather, previous_reader)
        previous_reader = _first_reader(order, gather)
    return order


def _is_all_gather(snode: Any) -> bool:
    from torch._inductor.utils import contains_collective

    op = getattr(snode.node, "op_overload", None)
    return contains_collective(snode) and op is not None and "all_gather" in str(op)


def _depends_on(snode: Any, names: set[str]) -> bool:
    return bool(names & set(snode.ancestors))


def _first_reader(order: list[Any], gather: Any) -> Any | None:
    """The first node after ``gather`` that reads its result and is neither a wait nor a
    collective: where its piece starts computing."""
    from torch._inductor.utils import contains_collective, contains_wait

    names = set(gather.get_operation_names())
    for n in order[order.index(gather) + 1:]:
        if _depends_on(n, names) and not contains_wait(n) and not contains_collective(n):
            return n
    return None


def _move_after(order: list[Any], gather: Any, anchor: Any) -> None:
    """Issue ``gather`` just after ``anchor``; the nodes between them that depend on it (its
    wait, the copies that unpack it) go just before the first node that reads any of them,
    so the wait stays as late as ``sink_waits`` put it. Nothing moves if ``anchor`` itself
    depends on the gather."""
    i, j = order.index(gather), order.index(anchor)
    dependents, kept = [], []
    names = set(gather.get_operation_names())
    for n in order[i + 1:j + 1]:
        if _depends_on(n, names):
            dependents.append(n)
            names |= set(n.get_operation_names())
        else:
            kept.append(n)
    if anchor in dependents:
        return
    rest = order[j + 1:]
    k = next((at for at, n in enumerate(rest) if _depends_on(n, names)), len(rest))
    order[i:] = kept + [gather] + rest[:k] + dependents + rest[k:]


PASSES = ["sink_waits", "raise_comms", bound_gather_prefetch]


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
