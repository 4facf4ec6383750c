"""What one block keeps for its backward, declared by each family as data: the memory
estimate (``fxmega.planning.estimate``) sizes it on a rank's local shapes and sums it per
recompute mode, without knowing which family it prices.

An entry ``Saved(name, count, width, dtype, residual, kind)`` is a tensor of ``tokens x
count x width`` elements of ``dtype`` (``count`` per token, fractional where a mixture of
experts runs its experts on fixed buffers: rows per token):

width     ``embed`` (d_model), ``q`` (local query heads x head_dim), ``kv`` (local key/value
          heads x head_dim), ``mlp`` (the local MLP hidden width), ``heads`` (local query
          heads), ``one``; in a mixture of experts ``experts`` (the router's outputs, never
          split), ``expert_mlp`` (a routed expert's local hidden width), ``shared_mlp``
          (the shared experts' local hidden width)
dtype     ``act`` (the compute dtype), ``fp32``, ``fp32_copy`` (an fp32 cast of an ``act``
          tensor: nothing when the compute dtype is fp32 already), ``int64`` (indices) or
          ``bool`` (masks)
residual  on the residual stream's side, so split along the sequence under sequence
          parallelism
kind      when it is kept (``fxmega.planning.estimate.KEPT``):
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
          ``gathered``        a gather or weighted copy of kept tensors (a MoE block's pairs:
                              eager autograd only; the compiled step fuses the gather into
                              the kernels that read it)
          ``combined``        the experts' outputs on their buffers, which the compiled step
                              keeps for the combine's backward (selective keeps them as a
                              matmul's output; eager autograd keeps a gathered copy instead)

``tests/test_plan_scale.py`` checks every family's table against the tensors autograd
really saves.
"""

from __future__ import annotations

from typing import NamedTuple


class Saved(NamedTuple):
    name: str
    count: float
    width: str
    dtype: str
    residual: bool
    kind: str


WIDTHS = ("embed", "q", "kv", "mlp", "heads", "one", "experts", "expert_mlp", "shared_mlp")
DTYPES = ("act", "fp32", "fp32_copy", "int64", "bool")
KINDS = ("input", "autograd_input", "region_input", "matmul", "attention", "norm_out", "projection_out", "other",
         "gathered", "combined")
