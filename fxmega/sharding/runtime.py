"""A sharding plan bound to a running process: its mesh coordinates, process groups, local
shards, and the pieces of the training step that cross ranks.

How the step is divided between DTensor and fxmega's own collectives:
  * Tensor (and sequence) parallelism runs on DTensors over the 1-D ``tp`` mesh. Model code
    names activation layouts with ``shard(...)``; this class turns those names into explicit
    ``redistribute`` calls, so Megatron's layouts are held on purpose (DTensor's own
    propagation picks slower ones), and runs attention per shard with ``local_map``.
  * The data axes (dp, fsdp) are handled here with bucketed functional collectives: each
    data rank computes on its own micro batches with plain local tensors, and gradients are
    reduced (all-reduce, or reduce-scatter for ZeRO) a bucket at a time; ZeRO-3/FSDP
    parameters are gathered per model piece (``zero3.py``).
Both end up as collectives inside the one compiled graph.

Leaf order everywhere is the spec tree's leaf order; ``layouts[i]`` describes leaf ``i``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from fxmega.core import precision, tree
from fxmega.ops.init import init_tensor
from fxmega.ops.recompute import checkpointed
from fxmega.sharding import collectives, layout
from fxmega.sharding.mesh import DATA_AXES, PHYSICAL_ORDER
from fxmega.sharding.plan import ParamLayout, ShardingPlan
from fxmega.sharding.zero3 import gathered_call


class PiecewiseLoss(Protocol):
    """A model's summed loss over a batch, run piece by piece through ``call`` (see
    ``Parallel._call``) with the pieces' ``layouts``; the runtime never names the model or
    the objective, it is handed this."""

    def __call__(self, params: dict, batch: dict[str, torch.Tensor], call: Callable[..., torch.Tensor],
                 layouts: dict) -> torch.Tensor: ...

class Parallel:
    """This rank's part of a sharded run: built once per process from the plan and the
    DeviceMesh, used by ``fxmega.training.train.Run`` (init, checkpoints) and by the compiled step."""

    def __init__(self, plan: ShardingPlan, device_mesh: Any, rank: int, specs: tree.Tree,
                 bucket_numel: int = 0, regather: bool = True, compute: Any = None) -> None:
        self.plan = plan
        self.spec = plan.mesh
        self.rank = rank
        self.coords = plan.mesh.coords(rank)
        self.device_mesh = device_mesh
        self.specs = specs
        self.layout_tree = tree.map_with_path(lambda path, _: plan.params[path], specs)
        self.layouts: list[ParamLayout] = tree.leaves(self.layout_tree)
        self.bucket_numel = bucket_numel
        self.regather = regather  # ZeRO-3: gather again in the backward (False keeps them: for measurements)
        self.compute = compute  # a ComputeConfig: precision, recompute, kernels (None: fp32, no recompute)
        self.compute_dtype = precision.compute_dtype(compute.precision) if compute is not None else torch.float32
        reduce_bf16 = compute is not None and compute.grad_reduce == "bf16"
        self.reduce_dtype = torch.bfloat16 if reduce_bf16 else torch.float32
        self.tp = plan.tp
        self.tp_mesh = device_mesh["tp"] if self.tp > 1 else None
        self._groups: dict[tuple[str, ...], Any] = {}
        self.data_axes = tuple(a for a in DATA_AXES if self.spec.size(a) > 1)
        # Everything the compiled step needs is decided here, in plain Python, so that the
        # traced code only walks lists: which tensors go in which bucket of which collective.
        param_axes = {lay.data_axes["param"] for lay in self.layouts if lay.data_axes["param"]}
        if len(param_axes) > 1:
            raise ValueError(f"parameters sharded over different data axes {param_axes}")
        self._gather_axes = next(iter(param_axes), ())
        self._gather = (self.size(self._gather_axes), self.group(self._gather_axes)) if self._gather_axes else None
        extra = lambda lay, kind, base: tuple(a for a in lay.data_axes[kind] if a not in lay.data_axes[base])  # noqa
        self._micro_schedule = self._schedule([("reduce_scatter", extra(lay, "grad", "param")) for lay in self.layouts])
        self._scatter_schedule = self._schedule([("reduce_scatter", extra(lay, "opt", "grad")) for lay in self.layouts])
        self._replica_schedule = self._schedule(
            [("all_reduce", tuple(a for a in self.data_axes if a not in lay.data_axes["opt"])) for lay in self.layouts])
        self._refresh_schedule = self._schedule([("all_gather", extra(lay, "opt", "param")) for lay in self.layouts])
        self._opt_slices = [self._opt_slice(lay) for lay in self.layouts]
        if self.data_axes:  # made here, not first inside a compiled step (flattening a mesh does not trace)
            self.group(self.data_axes)

    # -- groups -----------------------------------------------------------------------
    @property
    def gathers_params(self) -> bool:
        """Whether pieces gather their parameters before running (ZeRO-3 / FSDP)."""
        return self._gather is not None

    def group(self, axes: tuple[str, ...]) -> Any:
        """The process group (as a 1-D mesh) spanning ``axes``."""
        axes = tuple(a for a in PHYSICAL_ORDER if a in axes)
        if axes not in self._groups:
            sub = self.device_mesh[axes[0]] if len(axes) == 1 else self.device_mesh[axes]._flatten("_".join(axes))
            self._groups[axes] = sub
        return self._groups[axes]

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod([self.spec.size(a) for a in axes])

    def group_labels(self) -> dict[str, str]:
        """Process-group name -> the mesh axes it spans (for reading recorded collectives)."""
        labels = {dist.group.WORLD.group_name: "world"}
        for axes in list(self._groups):
            labels[self._groups[axes].get_group().group_name] = "+".join(axes)
        if self.tp_mesh is not None:
            labels[self.tp_mesh.get_group().group_name] = "tp"
        return labels

    @property
    def data_rank(self) -> int:
        return self.spec.data_rank(self.rank)

    @property
    def data_size(self) -> int:
        return self.spec.data_size

    # -- parameters -------------------------------------------------------------------
    def shard(self, full: torch.Tensor, lay: ParamLayout, kind: str = "param") -> torch.Tensor:
        """This rank's slice of a full (padded) tensor, for ``kind`` param/grad/opt."""
        t = full
        if lay.tp_dim is not None:
            t = t.chunk(self.tp, lay.tp_dim)[self.coords["tp"]]
        split = lay.data_split(kind)
        if lay.zero_dim is not None and split > 1:
            t = t.chunk(split, lay.zero_dim)[lay.data_index(kind, self.coords)]
        return t.contiguous()

    def pad(self, full: torch.Tensor, lay: ParamLayout) -> torch.Tensor:
        """Zero rows (or columns) appended to vocabulary dims that tp does not divide."""
        if tuple(full.shape) == lay.shape:
            return full
        pads: list[int] = []
        for have, want in reversed(list(zip(full.shape, lay.shape))):
            pads += [0, want - have]
        return torch.nn.functional.pad(full, pads)

    def init_params(self, seed: int, device: torch.device) -> tree.Tree:
        """Local shards of every parameter, equal to the slice of the single-device init."""
        def one(path: str, spec: Any) -> torch.Tensor:
            lay = self.plan.params[path]
            full = self.pad(init_tensor(spec, path, seed), lay)
            return self.shard(full, lay).to(device).requires_grad_(True)

        return tree.map_with_path(one, self.specs)

    def init_opt_state(self, device: torch.device) -> dict:
        zeros = lambda: [torch.zeros(lay.local_shape("opt"), device=device) for lay in self.layouts]  # noqa: E731
        return {"step": torch.zeros((), device=device), "exp_avg": zeros(), "exp_avg_sq": zeros()}

    def placements(self, lay: ParamLayout, kind: str) -> list:
        out = []
        for axis in self.spec.names:
            if axis == "tp" and lay.tp_dim is not None:
                out.append(Shard(lay.tp_dim))
            elif axis in lay.data_axes[kind]:
                out.append(Shard(lay.zero_dim))
            else:
                out.append(Replicate())
        return out

    def as_dtensor(self, local: torch.Tensor, lay: ParamLayout, kind: str = "param") -> DTensor:
        """A local shard as a DTensor over the whole mesh (for checkpoints and inspection)."""
        return DTensor.from_local(local, self.device_mesh, self.placements(lay, kind), run_check=False,
                                  shape=torch.Size(lay.shape), stride=_contiguous_stride(lay.shape))

    def full_tensors(self, flat: list[torch.Tensor], kind: str = "param") -> list[torch.Tensor]:
        """Every parameter gathered to its full (padded) value on every rank (eager)."""
        return [self.as_dtensor(t.detach(), lay, kind).full_tensor() for t, lay in zip(flat, self.layouts)]

    def full_params(self, params: tree.Tree, full_specs: tree.Tree) -> tree.Tree:
        """The whole model (``full_specs``' tree) as full (padded) tensors on every rank, from
        this rank's shards ``params`` (every rank takes part). Pipeline stages are exchanged
        with an all_gather_object over pp: for checking small models, not for 70B."""
        flat = self.full_tensors(tree.leaves(params))
        if self.plan.pipeline is None:
            return tree.unflatten_like(full_specs, flat)
        device = flat[0].device if flat else torch.device("cpu")
        mine = {p: t.cpu() for p, t in zip(tree.paths(self.specs), flat)}
        everyone: list[dict] = [{} for _ in range(self.spec.size("pp"))]
        dist.all_gather_object(everyone, mine, group=self.group(("pp",)).get_group())
        merged = {p: t for part in everyone for p, t in part.items()}
        return tree.map_with_path(lambda path, _: merged[path].to(device), full_specs)

    # -- activation layouts (the ActivationLayout protocol of sharding.layout) ----------
    def _tp_placement(self, axes: tuple[str | None, ...]) -> list:
        dim = self.plan.activation_tp_dims(axes)
        return [Replicate()] if dim is None else [Shard(dim)]

    def constrain(self, x: torch.Tensor, axes: tuple[str | None, ...]) -> torch.Tensor:
        target = self._tp_placement(axes)
        if not isinstance(x, DTensor):  # a plain tensor here is a full value (e.g. an arange)
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        return x.redistribute(self.tp_mesh, target)

    def local(self, fn: Callable[..., Any], in_axes: tuple, out_axes: tuple) -> Callable[..., Any]:
        in_placements = tuple(None if a is None else self._tp_placement(a) for a in in_axes)
        return local_map(fn, out_placements=self._tp_placement(out_axes), in_placements=in_placements,
                         device_mesh=self.tp_mesh)

    # -- the loss on local shards -----------------------------------------------------
    def _wrap(self, local: torch.Tensor, lay: ParamLayout) -> torch.Tensor:
        if self.tp_mesh is None:
            return local
        placement = [Shard(lay.tp_dim)] if lay.tp_dim is not None else [Replicate()]
        return DTensor.from_local(local, self.tp_mesh, placement, run_check=False)

    def _call(self, fn: Callable[..., Any], params: Any, lays: Any, *args: Any, recompute: str = "none") -> Any:
        """Run one piece of the model on this rank's parameters: cast to the compute dtype,
        gathered first under ZeRO-3, recomputed in the backward as ``recompute`` says."""
        leaves, leaf_lays = tree.leaves(params), tree.leaves(lays)

        def rebuild(ts: list[torch.Tensor]) -> Any:
            return tree.unflatten_like(params, [self._wrap(t, lay) for t, lay in zip(ts, leaf_lays)])

        dims = [lay.zero_dim if lay.data_axes["param"] else None for lay in leaf_lays]
        if self._gather is None or all(d is None for d in dims):
            return checkpointed(lambda ps, *a: fn(rebuild(precision.cast(ps, self.compute_dtype)), *a),
                                recompute)(leaves, *args)
        world, group = self._gather
        return gathered_call(fn, leaves, dims, world, group, rebuild, *args, regather=self.regather,
                             recompute=recompute, dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)

    def loss_sum_fn(self, model_loss: PiecewiseLoss) -> Callable[[list[torch.Tensor], dict], torch.Tensor]:
        """``(flat local params, local batch) -> this data rank's summed loss`` (a plain
        tensor), for ``fxmega.training.step``: ``model_loss`` run with this rank's parameter tree,
        its piece call (cast, ZeRO-3 gather, recompute) and its layouts."""

        def loss_sum(flat: list[torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
            params = tree.unflatten_like(self.layout_tree, flat)
            if self.tp_mesh is not None:  # every tp rank reads the same tokens
                batch = {k: DTensor.from_local(v, self.tp_mesh, [Replicate()], run_check=False)
                         for k, v in batch.items()}
            with layout.activate(self if self.tp_mesh is not None else None):
                loss = model_loss(params, batch, self._call, self.layout_tree)
            if isinstance(loss, DTensor):  # may still be a partial sum over tp: reduce it
                loss = loss.redistribute(self.tp_mesh, [Replicate()]).to_local()
            return loss

        return loss_sum

    # -- gradients and the update (called inside the compiled step) ---------------------
    def _schedule(self, ops: list[tuple[str, tuple[str, ...]]]) -> list[tuple[str, Any, int, list[int], list]]:
        """``(op, group, world, tensor indices, dims)`` per bucket, for per-tensor ops."""
        out = []
        for op, axes in sorted({o for o in ops if o[1]}):
            idx = [i for i, o in enumerate(ops) if o == (op, axes)]
            numels = [self.layouts[i].local_numel("grad") for i in idx]
            for bucket in collectives.buckets(numels, self.bucket_numel):
                members = [idx[b] for b in bucket]
                dims = [self.layouts[i].zero_dim for i in members]
                out.append((op, self.group(axes), self.size(axes), members, dims))
        return out

    @staticmethod
    def _run(schedule: list, tensors: list[torch.Tensor],
             reduce_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        out = list(tensors)
        for op, group, world, members, dims in schedule:
            chunk = [tensors[i] for i in members]
            if op == "all_reduce":
                results = collectives.all_reduce(chunk, group, reduce_dtype)
            elif op == "reduce_scatter":
                results = collectives.reduce_scatter(chunk, dims, world, group, reduce_dtype)
            else:
                results = collectives.all_gather(chunk, dims, world, group)
            for i, r in zip(members, results):
                out[i] = r
        return out

    def micro_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per micro batch: reduce-scatter where gradients are sharded beyond the parameters
        (ZeRO-2's dp). What stays is accumulated locally."""
        return self._run(self._micro_schedule, grads, self.reduce_dtype)

    def final_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """After the last micro batch: reduce-scatter onto the optimizer shards (ZeRO-1's dp)
        and all-reduce over the data axes that hold replicas (plain data parallelism)."""
        reduce = self.reduce_dtype
        return self._run(self._replica_schedule, self._run(self._scatter_schedule, grads, reduce), reduce)

    def _opt_slice(self, lay: ParamLayout) -> tuple[int, int, int] | None:
        extra = [a for a in lay.data_axes["opt"] if a not in lay.data_axes["param"]]
        if not extra:
            return None
        split = self.size(tuple(extra))
        index = 0
        for axis in extra:
            index = index * self.spec.size(axis) + self.coords[axis]
        rows = lay.local_shape("param")[lay.zero_dim] // split
        return lay.zero_dim, index * rows, rows

    def opt_views(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """The part of each local parameter this rank's optimizer shard updates (a view)."""
        return [p if sl is None else p.narrow(*sl) for p, sl in zip(flat, self._opt_slices)]

    def refresh_params(self, flat: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        """After a ZeRO-1/2 update: all-gather the updated shards back into every replica."""
        full = self._run(self._refresh_schedule, views)
        for _, _, _, members, _ in self._refresh_schedule:
            for i in members:
                flat[i].copy_(full[i])

    def norm_weights(self, device: torch.device) -> torch.Tensor:
        """1 where this rank's optimizer-layout gradient counts towards the global norm, 0
        where another rank holds the same values (tp or data replicas): each element once."""
        weights = []
        for lay in self.layouts:
            replicated = [a for a in self.data_axes if a not in lay.data_axes["opt"]]
            if lay.tp_dim is None and self.tp > 1:
                replicated.append("tp")
            weights.append(1.0 if all(self.coords[a] == 0 for a in replicated) else 0.0)
        return torch.tensor(weights, device=device)

    def sum_over_world(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    def sum_over_data(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        if not self.data_axes:
            return x
        return funcol.all_reduce(x, "sum", self.group(self.data_axes))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
