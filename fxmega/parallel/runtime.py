"""A sharding plan bound to a running process, made of focused parts:

  * ``groups`` (``ProcessGroups``): this rank's coordinates and the process groups over the
    mesh's axes;
  * ``shards`` (``ParamShards``): this rank's slice of every parameter, the seeded sharded
    init, DTensor views for checkpoints, and the way back to full tensors;
  * ``activations`` (``ActivationLayouts``, None without tp, cp and ep): the layouts model
    code names with ``shard(...)`` and ``local(...)``, held on DTensors over the 1-D tp mesh,
    under cp the collectives attention reaches the other chunks with, under ep the
    all-to-all that carries tokens to their experts;
  * ``grads`` (``GradientSync``): the data axes' bucketed gradient reductions (all-reduce,
    or reduce-scatter for ZeRO) and the all-gather after a sharded update.

``Parallel`` itself runs a model piece on this rank's parameters (``call``: cast, ZeRO-3 /
FSDP gather per piece, recompute) and builds the loss the compiled step differentiates
(``loss_sum_fn``). Tensor parallelism runs on DTensors; the data axes on plain local tensors
with functional collectives. Both end up as collectives inside the one compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from fxmega.config import ComputeConfig
from fxmega.core import precision, tree
from fxmega.ops.recompute import checkpointed
from fxmega.optim.matrices import matrix_view
from fxmega.optim.optimizer import Optimizer, ParamRole, init_state
from fxmega.parallel.activation_layouts import ActivationLayouts
from fxmega.parallel.context import ContextParallel, chunk_of
from fxmega.parallel.grad_sync import GradientSync
from fxmega.parallel.groups import ProcessGroups
from fxmega.parallel.matrix_pieces import with_pieces
from fxmega.parallel.param_shards import ParamShards
from fxmega.parallel.zero3 import Fp8Gather, gathered_call
from fxmega.sharding import layout
from fxmega.sharding.mesh import PHYSICAL_ORDER
from fxmega.sharding.plan import ShardingPlan


class PiecewiseLoss(Protocol):
    """A model's summed loss over a batch, run piece by piece through ``call`` (see
    ``Parallel.call``) with the pieces' ``layouts``; the runtime never names the model or
    the objective, it is handed this."""

    def __call__(self, params: dict, batch: dict[str, torch.Tensor], call: Callable[..., torch.Tensor],
                 layouts: dict) -> torch.Tensor: ...


class Parallel:
    """This rank's part of a sharded run: built once per process from the plan and the
    DeviceMesh (``fxmega.parallel.distributed.setup``), used by the training loop (init,
    checkpoints), the compiled steps, evaluation and generation."""

    def __init__(self, plan: ShardingPlan, device_mesh: DeviceMesh, rank: int, specs: tree.Tree,
                 bucket_numel: int = 0, regather: bool = True, compute: ComputeConfig | None = None,
                 cp_attention: str = "allgather", whole_matrices: bool = False) -> None:
        self.plan, self.rank, self.specs = plan, rank, specs
        self.regather = regather  # ZeRO-3: gather again in the backward (False keeps them: for measurements)
        self.compute = compute  # precision, recompute, kernels (None: fp32, no recompute)
        self.compute_dtype = precision.compute_dtype(compute.precision) if compute is not None else torch.float32
        reduce_bf16 = compute is not None and compute.grad_reduce == "bf16"
        self.reduce_dtype = torch.bfloat16 if reduce_bf16 else torch.float32
        self.groups = ProcessGroups(plan.mesh, device_mesh, rank)
        self.shards = ParamShards(plan, self.groups, specs)
        cp_mesh = self.groups.cp_mesh
        self.context = (ContextParallel(cp_mesh, self.groups.cp, cp_attention, cp_mesh.get_local_rank())
                        if cp_mesh is not None else None)
        tp_mesh = self.groups.tp_mesh
        exchanges = plan.mesh.size("ep") > 1  # MoE layers send tokens to their experts' ranks
        self.activations = (ActivationLayouts(plan, tp_mesh, self.context, self.groups)
                            if tp_mesh is not None or self.context is not None or exchanges else None)
        whole = [spec.sign_rate > 0 for spec in tree.leaves(specs)]  # updates that read the whole gradient
        # an optimizer that updates whole matrices (``whole_matrices``): under the distributed
        # optimizer each hidden matrix has one owner rank (``fxmega.parallel.flat_optimizer``)
        owned = [whole_matrices and matrix_view(spec) is not None for spec in tree.leaves(specs)]
        self.grads = GradientSync(self.groups, self.shards.layouts, bucket_numel, self.reduce_dtype,
                                  plan.strategy.flat, whole, flat_grads=plan.zero >= 2, owned=owned)
        # ZeRO-3 / FSDP: the groups parameters are gathered over (experts, split over ep, over fewer ranks)
        self._gathers = {axes: (axes, self.groups.size(axes), self.groups.group(axes))
                         for axes in (lay.data_axes["param"] for lay in self.shards.layouts) if axes}
        self._fp8_gathers: dict[str, Fp8Gather] = {}  # ``gather_in_fp8``

    def gather_in_fp8(self, paths: frozenset[str]) -> None:
        """Gather this rank's parameters at ``paths`` (those ZeRO-3 gathers) as fp8 bytes with
        their tensorwise scales (``compute.fp8_gather``; which ones: ``ops.fp8.gathered_in_fp8``),
        each amax maxed over the ranks holding its pieces: the data axes, and tp where tp
        splits it too (its scale is the whole weight's). Set before the first step is traced
        (the groups are made here: a traced step cannot make them)."""
        self._fp8_gathers = {}
        for lay in self.shards.layouts:
            if lay.path in paths and lay.data_axes["param"]:
                spread = set(lay.data_axes["param"]) | ({"tp"} if lay.tp_dim is not None else set())
                axes = tuple(a for a in PHYSICAL_ORDER if a in spread)
                self._fp8_gathers[lay.path] = axes, self.groups.group(axes)

    @property
    def fp8_gathered(self) -> frozenset[str]:
        return frozenset(self._fp8_gathers)

    def init_opt_state(self, optimizer: Optimizer, device: torch.device | str) -> dict:
        """Fresh state of ``optimizer`` for this rank's optimizer shard: each of its state
        tensors laid out as the parameters' optimizer views."""
        return init_state(optimizer, lambda dtype: self.grads.init_opt_moments(device, dtype), device)

    def optimizer_roles(self, roles: list[ParamRole], optimizer: Optimizer) -> list[ParamRole]:
        """``roles`` of this rank's parameters, with the pieces of each hidden matrix the layout
        slices where ``optimizer`` updates whole matrices (``fxmega.parallel.matrix_pieces``)."""
        return with_pieces(roles, self.shards, self.groups) if optimizer.whole_matrices else roles

    @property
    def gathers_params(self) -> bool:
        """Whether pieces gather their parameters before running (ZeRO-3 / FSDP)."""
        return bool(self._gathers)

    def call(self, fn: Callable[..., Any], params: dict, lays: dict, *args: Any, recompute: str = "none") -> Any:
        """Run one piece of the model on this rank's parameters: cast to the compute dtype,
        gathered first under ZeRO-3, recomputed in the backward as ``recompute`` says (the
        ``call`` of ``fxmega.models.pieces.run_pieces``)."""
        leaves, leaf_lays = tree.leaves(params), tree.leaves(lays)
        tp = self.activations  # tp and/or cp

        def rebuild(ts: list[torch.Tensor]) -> dict:
            return tree.unflatten_like(params, ts if tp is None else [tp.wrap_param(t, lay)
                                                                      for t, lay in zip(ts, leaf_lays)])

        dims = [lay.zero_dim if lay.data_axes["param"] else None for lay in leaf_lays]
        if all(d is None for d in dims):
            return checkpointed(lambda ps, *a: fn(rebuild(precision.cast(ps, self.compute_dtype)), *a),
                                recompute)(leaves, *args)
        gathers = [self._gathers.get(lay.data_axes["param"]) for lay in leaf_lays]
        return gathered_call(fn, leaves, dims, gathers, rebuild, *args, regather=self.regather,
                             recompute=recompute, dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype,
                             fp8_gathers=[self._fp8_gathers.get(lay.path) for lay in leaf_lays])

    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this rank reads of one of its data rank's micro batches: all of it, or under
        cp its head-tail chunks of every sequence with their positions."""
        cp = self.groups.cp
        return batch if cp == 1 else chunk_of(batch, self.groups.coords["cp"], cp)

    def loss_sum_fn(self, model_loss: PiecewiseLoss) -> Callable[[list[torch.Tensor], dict], torch.Tensor]:
        """``(flat local params, local batch) -> this data rank's summed loss`` (a plain
        tensor), for ``fxmega.training.step``: ``model_loss`` run with this rank's parameter tree,
        its piece call (cast, ZeRO-3 gather, recompute) and its layouts."""
        act, context = self.activations, self.context

        def loss_sum(flat: list[torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
            if context is not None:  # each cp rank's gradients cover its own chunks: sum them
                flat = [context.sum_grads(p) for p in flat]
            params = tree.unflatten_like(self.shards.layout_tree, flat)
            if act is not None:  # every tp rank reads the same tokens (a cp rank its chunks: ``local_batch``)
                batch = {k: act.wrap(v, None) for k, v in batch.items()}
            with layout.activate(act):
                loss = model_loss(params, batch, self.call, self.shards.layout_tree)
            # may still be a partial sum over tp's vocabulary: reduce it (over cp it stays
            # this rank's chunks' sum, which the step sums over the token axes)
            return loss if act is None else act.to_replicated_local(loss)

        return loss_sum
