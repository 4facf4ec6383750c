"""What one block keeps for its backward, declared by each family as data: the memory
estimate (``fxmega.sharding.estimate``) sizes it on a rank's local shapes and sums it per
recompute mode, without knowing which family it prices.

An entry ``Saved(name, count, width, dtype, residual, kind)`` is a tensor of ``tokens x
count x width`` elements of ``dtype``:

width     ``embed`` (d_model), ``q`` (local query heads x head_dim), ``kv`` (local key/value
          heads x head_dim), ``mlp`` (the local MLP hidden width), ``heads`` (local query
          heads), ``one``
dtype     ``act`` (the compute dtype) or ``fp32``
residual  on the residual stream's side, so split along the sequence under sequence
          parallelism
kind      when it is kept (``fxmega.sharding.estimate.KEPT``):
          ``input``           the block's input, kept in every mode
          ``autograd_input``  a copy of the input that only plain autograd keeps (an fp32 cast)
          ``region_input``    the input as a recomputed region keeps it (selective, full)
          ``matmul``          a projection's output (none, selective)
          ``attention``       the attention kernel's output and log-sum-exp (every mode)
          ``norm_out``        a norm's output, the projections' input (eager autograd only:
                              the compiled whole step recomputes it from the statistics)
          ``projection_out``  an output projection's partial sum, which only selective
                              recompute keeps
          ``other``           norm statistics, activations, products (plain autograd only)

``tests/test_plan_scale.py`` checks every family's table against the tensors autograd
really saves.
"""

from __future__ import annotations

from typing import NamedTuple


class Saved(NamedTuple):
    name: str
    count: int
    width: str
    dtype: str
    residual: bool
    kind: str


WIDTHS = ("embed", "q", "kv", "mlp", "heads", "one")
DTYPES = ("act", "fp32")
KINDS = ("input", "autograd_input", "region_input", "matmul", "attention", "norm_out", "projection_out", "other")
