"""What a step sends, per rank and mesh axis, from the plan alone (the companion of
``fxmega.planning.estimate``, whose block shapes it reads).

Communication per step, bytes each rank sends (ring algorithms: all-reduce 2(W-1)/W of the
buffer, all-gather and reduce-scatter (W-1)/W of the full buffer), per mesh axis:
  tp    Megatron's f/g operators: per block two all-reduces forward and two backward of the
        [tokens, embed] activations (sequence parallel: all-gathers and reduce-scatters of
        the same total); full recompute repeats the forward's; the embedding, the head and
        the vocab-parallel cross-entropy add a few more.
  data  gradient all-reduce (ZeRO-0), reduce-scatter + parameter all-gather (ZeRO-1/2),
        ZeRO-3's gathers of every piece in the forward and again in the backward, and
        reduce-scatter of its gradients, per micro batch.
  cp    attention's exchanges of keys and values (all-gather, ring or all-to-all) and the
        gradients' sum over cp (``_cp_traffic``).
  ep    the experts' all-to-alls of their fixed buffers, there and back, forward and
        backward, per MoE block and micro batch (``_ep_traffic``).
  pp    each stage boundary sends activations forward and gradients back per micro batch.
  Muon  with an optimizer that updates whole matrices, each hidden matrix a rank holds a
        slice of is all-gathered (fp32) over the data axes that cut it, then over tp
        (``fxmega.parallel.matrix_pieces``), once per step: ``muon_all_gather``.
        ``whole_matrix_minimum`` is the least any scheme sends for it (each matrix to one
        owner rank and its result back). Under the distributed optimizer that is the scheme
        over the data axes: the matrices' by-owner buckets are counted with its reduce-
        scatters and all-gathers, their padding to the most loaded rank included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fxmega.models import model_for
from fxmega.models.family import ModelConfig
from fxmega.optim.matrices import MatrixView
from fxmega.parallel import collectives
from fxmega.parallel.flat_optimizer import owner_buffer_numel, owner_packing
from fxmega.planning.estimate import (
    DTYPE_BYTES,
    FP32,
    BlockShape,
    Workload,
    block_shapes,
    first_shape,
    recompute_mode,
    saved_count,
    vocab_split,
)
from fxmega.sharding.mesh import DATA_AXES, PHYSICAL_ORDER
from fxmega.sharding.plan import ShardingPlan


@dataclass
class AxisTraffic:
    bytes_sent: float = 0.0
    collectives: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    op_bytes: dict[str, float] = field(default_factory=dict)  # bytes_sent by op

    def add(self, op: str, count: int, buffer_bytes: float, world: int, to_neighbour: bool = False) -> None:
        """``count`` collectives of ``op`` on ``buffer_bytes`` over ``world`` ranks (an
        all-to-all ``to_neighbour`` sends the whole buffer to one rank, as a ring step does)."""
        if world <= 1 or count <= 0:
            return
        factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
        if op in ("send", "recv") or to_neighbour:
            factor = 1.0
        self.bytes_sent += count * factor * buffer_bytes
        self.collectives += count
        self.ops[op] = self.ops.get(op, 0) + count
        self.op_bytes[op] = self.op_bytes.get(op, 0.0) + count * factor * buffer_bytes


def communication(plan: ShardingPlan, model_cfg: ModelConfig, work: Workload,
                  bucket_numel: int = 40_000_000, pp_rank: int = 0,
                  matrices: dict[str, MatrixView] | None = None,
                  fp8_gathered: frozenset[str] = frozenset()) -> dict[str, AxisTraffic]:
    """Bytes each rank of pp rank ``pp_rank`` sends per step, and collectives, per mesh axis.
    ``matrices``: the hidden matrices of an optimizer that updates them whole (Muon), by path;
    ``fp8_gathered``: the parameters ZeRO-3 gathers in fp8 (``compute.fp8_gather``), by path."""
    mesh, act = plan.mesh, work.act_bytes
    traffic: dict[str, AxisTraffic] = {}
    shapes = block_shapes(plan, model_cfg, work)
    shape = first_shape(plan, model_cfg, work, shapes)
    mine = [p for p in plan.params.values() if pp_rank in plan.pp_owners(p.path)]
    blocks = sorted({int(p.path.split(".")[1]) for p in mine if p.path.startswith("blocks.")})
    n = work.n_micro
    tp = plan.tp
    if tp > 1:
        _tp_traffic(plan, work, shapes, blocks, pp_rank, traffic.setdefault("tp", AxisTraffic()))
    if mesh.size("ep") > 1:
        _ep_traffic(work, shapes, blocks, mesh.size("ep"), traffic.setdefault("ep", AxisTraffic()))
    if work.cp > 1:
        _cp_traffic(work, shape, blocks, mine, traffic.setdefault("cp", AxisTraffic()))
    data_axes = tuple(a for a in DATA_AXES if mesh.size(a) > 1)
    if data_axes:
        _data_traffic(plan, mine, work, bucket_numel, traffic, model_groups(model_cfg),
                      embed_backward_reads_params(model_cfg), matrices or {}, fp8_gathered)
    for axes, numel, world in matrix_gathers(plan, mine, orthogonalised_here(plan, mine, matrices or {},
                                                                               bucket_numel)):
        traffic.setdefault("+".join(axes), AxisTraffic()).add("muon_all_gather", 1, numel * FP32, world)
    token_axes = data_axes + (("cp",) if work.cp > 1 else ())
    if token_axes:  # the step's loss, summed over the data ranks and cp's chunks
        traffic.setdefault("+".join(token_axes), AxisTraffic()).add("all_reduce", 1, FP32,
                                                                     mesh.data_size * work.cp)
    if mesh.world_size > 1:  # the global gradient norm (on the one axis's group when only one is split)
        split = tuple(a for a in mesh.names if mesh.size(a) > 1)
        world = "+".join(split) if split in (data_axes, token_axes) or len(split) == 1 else "world"
        traffic.setdefault(world, AxisTraffic()).add("all_reduce", 1, FP32, mesh.world_size)
    pipe = plan.pipeline
    if pipe is not None:
        pt = traffic.setdefault("pp", AxisTraffic())
        boundary = work.tokens * shape.embed * act // shape.seq_split
        stages = pipe.stages_of(pp_rank)
        sends = sum(1 for s in stages if s.index < pipe.n_stages - 1) + sum(1 for s in stages if s.index > 0)
        pt.add("send", sends * n, boundary, 2)
        if any(len(plan.pp_owners(p.path)) > 1 for p in mine):  # the tied embedding's gradient
            tied = sum(p.local_numel("opt") for p in mine if len(plan.pp_owners(p.path)) > 1)
            pt.add("all_reduce", 1, tied * FP32, 2)
    return traffic


def _cp_traffic(work: Workload, shape: BlockShape, blocks: list[int], mine: list, out: AxisTraffic) -> None:
    """Collectives over cp, per micro batch (counted in traced graphs of GPT on fake cp
    meshes, tests/test_plan_scale.py). The positions of the other chunks are gathered once
    per micro batch for every block's mask (``attend_inputs``). Attention, per block:
    all-gather reaches the other chunks' keys and values in the forward (again in a
    recomputed forward) and reduce-scatters their gradients; all-to-all (Ulysses)
    exchanges q, k and v for head groups and the output back, forward and backward; the
    ring passes k and v (and in the backward their gradients) to the next rank, one chunk
    pair per step. Every parameter's gradient (a partial sum over
    the rank's chunks) is all-reduced over cp, in fp32, once per micro batch."""
    cp, n, act = work.cp, work.n_micro, work.act_bytes
    kv_full = work.tokens * cp * shape.kv_heads * shape.head_dim * act
    q_local = work.tokens * shape.heads * shape.head_dim * act
    kv_local = work.tokens * shape.kv_heads * shape.head_dim * act
    positions_full = work.tokens * cp * 8  # int64
    forwards = len(blocks) + sum(1 for i in blocks if recompute_mode(work, i) == "full")
    if work.cp_attention == "ring":
        # each forward: cp - 1 steps passing k and v on; each backward: cp - 1 steps passing
        # k, v and their fp32 gradients (one exchange per dtype), and one more bringing the
        # gradients home
        grads = 2 * work.tokens * shape.kv_heads * shape.head_dim * FP32
        out.add("all_to_all", forwards * (cp - 1) * n, 2 * kv_local, cp, to_neighbour=True)
        if act == FP32:
            out.add("all_to_all", len(blocks) * (cp - 1) * n, 2 * kv_local + grads, cp, to_neighbour=True)
        else:
            out.add("all_to_all", len(blocks) * (cp - 1) * n, 2 * kv_local, cp, to_neighbour=True)
            out.add("all_to_all", len(blocks) * (cp - 1) * n, grads, cp, to_neighbour=True)
        out.add("all_to_all", len(blocks) * n, grads, cp, to_neighbour=True)
    elif work.cp_attention == "allgather":
        out.add("all_gather", n if blocks else 0, positions_full, cp)
        out.add("all_gather", 2 * forwards * n, kv_full, cp)
        out.add("reduce_scatter", 2 * len(blocks) * n, kv_full, cp)
    else:
        out.add("all_gather", n if blocks else 0, positions_full, cp)
        per_block = 2 * q_local + 2 * kv_local  # q, the output, k, v of this rank's tokens
        out.add("all_to_all", 4 * (forwards + len(blocks)) * n, per_block / 4, cp)
    for p in mine:
        out.add("all_reduce", n, p.local_numel("param") * FP32, cp)


def _ep_traffic(work: Workload, shapes: dict[int, BlockShape], blocks: list[int], ep: int,
                out: AxisTraffic) -> None:
    """All-to-alls over ep, per MoE block and micro batch (``fxmega.ops.moe``): the expert
    buffers [E, sequences x rows, d] go to their experts' ranks and the outputs come back,
    forward and backward; a recomputed forward exchanges them again."""
    for i in blocks:
        b = shapes[i]
        rows = saved_count(b, "moe.buffers")
        if not rows:
            continue
        buffers = b.tokens * rows * b.embed * work.act_bytes
        forwards = 2 if recompute_mode(work, i) == "none" else 3
        out.add("all_to_all", 2 * forwards * work.n_micro, buffers, ep)


def _tp_traffic(plan: ShardingPlan, work: Workload, shapes: dict[int, BlockShape], blocks: list[int], pp_rank: int,
                out: AxisTraffic) -> None:
    """Collectives over tp, as the compiled step holds them (counted in traced graphs of GPT
    and Llama steps on fake meshes; tests/test_plan_scale.py compares them exactly without
    recompute). Under full recompute the remat pass decides which forward collectives it
    redoes; the counts here (one all-reduce per block, two gathers and scatters with
    sequence parallelism) are close to, not equal to, what it does.

    A MoE block's experts return partial sums over tp, so the gradients reaching the router
    (the pairs' weights [tokens, k]) and the tokens are partial too: DTensor reduce-scatters
    them over the tokens, runs the router's backward on each rank's share, all-reduces the
    router weight's gradient and gathers the tokens' gradient back (counted in traced steps:
    per MoE block two reduce-scatters and a gather in place of the MLP's input all-reduce,
    plus the router's all-reduce; with sequence parallelism the tokens' scatter is the
    block's own)."""
    shape = shapes[min(shapes)]  # the widths tp traffic reads are alike in every block
    tp, n, act = plan.tp, work.n_micro, work.act_bytes
    act_bytes = work.tokens * shape.embed * act
    full = [i for i in blocks if recompute_mode(work, i) == "full"]
    has_head = plan.pipeline is None or any(s.head for s in plan.pipeline.stages_of(pp_rank))
    has_embed = plan.pipeline is None or any(s.embed for s in plan.pipeline.stages_of(pp_rank))
    moe = [shapes[i] for i in blocks if shapes[i].experts]
    for b in moe:  # the router's partial gradients (docstring)
        out.add("reduce_scatter", n, b.tokens * saved_count(b, "moe.topk_indices") * FP32, tp)
        out.add("all_gather", n, act_bytes, tp)
        out.add("all_reduce", n, b.embed * b.experts * FP32, tp)
        if not plan.sequence_parallel:  # the tokens' gradient scattered (and gathered) instead of all-reduced
            out.add("reduce_scatter", n, act_bytes, tp)
    norms = [p for p in plan.params.values() if p.path.startswith("blocks.0.") and "norm" in p.path]
    final_norms = [p for p in plan.params.values() if p.path.startswith("final_norm")]
    if plan.sequence_parallel:
        # per block: all-gather before and reduce-scatter after each sublayer, forward and
        # backward (full recompute gathers and scatters the forward's again); the norms'
        # weight gradients are partial sums over the sequence shards: one all-reduce each
        redone = [i for i in blocks if recompute_mode(work, i) != "none"]  # recompute redoes the forward's gathers
        out.add("all_gather", (4 * len(blocks) + 2 * len(redone)) * n, act_bytes, tp)
        out.add("reduce_scatter", (4 * len(blocks) + 2 * len(full)) * n, act_bytes, tp)
        out.add("all_reduce", len(norms) * len(blocks) * n, shape.embed * FP32, tp)
        if has_embed:  # the embedding's partial sums scattered onto sequence shards, gathered back in
            # the backward; learned positions: their gradient gathered from the sequence shards
            positions = any("position" in p.axes for p in plan.params.values())
            out.add("reduce_scatter", n, act_bytes, tp)
            out.add("all_gather", n * (2 if positions else 1), act_bytes, tp)
        if has_head:  # gathered for the output projection, its gradient scattered back
            out.add("all_gather", n, act_bytes, tp)
            out.add("reduce_scatter", n, act_bytes, tp)
            out.add("all_reduce", len(final_norms) * n, shape.embed * FP32, tp)
    else:
        # Megatron's f/g: two all-reduces per block forward and two backward; full recompute
        # repeats one of them (the attention's output is kept, see fxmega.ops.recompute)
        out.add("all_reduce", (4 * len(blocks) - len(moe) + len(full) + (1 if full else 0)) * n, act_bytes, tp)
        if has_embed and vocab_split(plan):
            out.add("all_reduce", n, act_bytes, tp)  # the vocab-parallel embedding's partial sums
        if has_head:
            out.add("all_reduce", n, act_bytes, tp)  # the head's input gradient
    if has_head:
        # vocab-parallel cross-entropy: max, sum of exp, target logit; then the loss's partial sum
        out.add("all_reduce", 3 * n, work.tokens * FP32, tp)
        out.add("all_reduce", n, FP32, tp)


def model_groups(model_cfg: ModelConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The model's embedding and head parameter groups (ZeRO-3 gathers each as one piece)."""
    model = model_for(model_cfg)
    return model.EMBED_PARAMS, model.head_groups(model.param_specs(model_cfg))


def embed_backward_reads_params(model_cfg: ModelConfig) -> bool:
    """Whether the family's embedding needs its parameters in the backward (BERT's ends with
    a LayerNorm; a plain lookup plus positions does not), so ZeRO-3 gathers it again there."""
    return model_for(model_cfg).EMBED_BACKWARD_READS_PARAMS


def _matrix_cuts(plan: ShardingPlan, p: Any, view: MatrixView) -> list[tuple[tuple[str, ...], int]]:
    """The (axes, ranks) that cut a hidden matrix's rows or columns in its optimizer view, in
    the order they are gathered: the data axes, then tp."""
    cuts = []
    if p.zero_dim is not None and p.data_split("opt") > 1 and p.zero_dim not in view.batch:
        cuts.append((tuple(p.data_axes["opt"]), p.data_split("opt")))
    if p.tp_dim is not None and plan.tp > 1 and p.tp_dim not in view.batch:
        cuts.append((("tp",), plan.tp))
    return cuts


def _owner_buckets(plan: ShardingPlan, mine: list, matrices: dict[str, MatrixView], bucket_numel: int
                   ) -> list[tuple[tuple[str, ...], list, int]]:
    """``(axes, member parameters, ranks)`` of the distributed optimizer's by-owner buckets
    (``fxmega.parallel.flat_optimizer``): the hidden matrices with replicas over the data
    axes, grouped and bucketed as the runtime does."""
    data_axes = tuple(a for a in DATA_AXES if plan.mesh.size(a) > 1)
    owned: dict[tuple[str, ...], list] = {}
    for p in mine:
        if p.path in matrices and p.replica_axes(data_axes):
            owned.setdefault(p.replica_axes(data_axes), []).append(p)
    out = []
    for axes, ps in sorted(owned.items()):
        world = math.prod(plan.mesh.size(a) for a in axes)
        out += [(axes, [ps[i] for i in bucket], world)
                for bucket in collectives.buckets([p.local_numel("grad") for p in ps], bucket_numel)]
    return out


def orthogonalised_here(plan: ShardingPlan, mine: list, matrices: dict[str, MatrixView],
                        bucket_numel: int) -> dict[str, MatrixView]:
    """The hidden matrices rank 0 of the data axes orthogonalises: all of them, except under
    the distributed optimizer, where a matrix with data replicas is its owner's alone (the
    others receive the result in the all-gather that refreshes the replicas)."""
    if not plan.strategy.flat:
        return matrices
    buckets = _owner_buckets(plan, mine, matrices, bucket_numel)
    shared = {p.path for _, ps, _ in buckets for p in ps}
    kept = {path: view for path, view in matrices.items() if path not in shared}
    for _, ps, world in buckets:
        kept |= {ps[k].path: matrices[ps[k].path] for k in owner_packing([p.local_numel("grad") for p in ps], world)[0]}
    return kept


def matrix_gathers(plan: ShardingPlan, mine: list, matrices: dict[str, MatrixView]) -> list[tuple]:
    """``(axes, gathered elements, ranks)`` of each all-gather that makes a sliced hidden
    matrix whole for the optimizer (``fxmega.parallel.matrix_pieces``)."""
    out = []
    for p in mine:
        if p.path not in matrices:
            continue
        numel = p.local_numel("opt")
        for axes, world in _matrix_cuts(plan, p, matrices[p.path]):
            numel *= world
            out.append((axes, numel, world))
    return out


def whole_matrix_minimum(plan: ShardingPlan, mine: list, matrices: dict[str, MatrixView]) -> float:
    """The least bytes a rank sends per step to orthogonalise the sliced matrices exactly once:
    each matrix assigned to one of the W ranks that hold its slices, which receives them and
    sends each rank its part of the result (Megatron's layer-wise distributed optimizer).
    Averaged over owners, a rank sends 2 (W - 1) / W of its own slice of each."""
    total = 0.0
    for p in mine:
        cuts = _matrix_cuts(plan, p, matrices[p.path]) if p.path in matrices else []
        if cuts:
            world = math.prod(w for _, w in cuts)
            total += 2 * (world - 1) / world * p.local_numel("opt") * FP32
    return total


def _data_traffic(plan: ShardingPlan, mine: list, work: Workload, bucket_numel: int,
                  traffic: dict[str, AxisTraffic], groups: tuple[tuple[str, ...], tuple[str, ...]],
                  embed_regathered: bool, matrices: dict[str, MatrixView], fp8_gathered: frozenset[str]) -> None:
    """The data axes' collectives, as ``Parallel`` schedules them: each op over the axes it
    spans (HSDP: gathers over fsdp, replica all-reduce over dp), bucketed the same way.
    ``matrices``: the hidden matrices of a whole-matrix optimizer (by-owner buckets under the
    distributed optimizer)."""
    mesh, n = plan.mesh, work.n_micro
    reduce = FP32 if work.grad_reduce == "fp32" else 2

    def extra(p: Any, kind: str, base: str) -> tuple[str, ...]:
        return tuple(a for a in p.data_axes[kind] if a not in p.data_axes[base])

    def add(op: str, axes: tuple[str, ...], count: int, buffer_bytes: float) -> None:
        world = math.prod(mesh.size(a) for a in axes)
        traffic.setdefault("+".join(axes), AxisTraffic()).add(op, count, buffer_bytes, world)

    def scheduled(op: str, axes_of: Any, numel_of: Any, count: int, itemsize: int) -> None:
        groups: dict[tuple[str, ...], list] = {}
        for p in mine:
            if axes_of(p):
                groups.setdefault(axes_of(p), []).append(p)
        for axes, ps in sorted(groups.items()):
            for bucket in collectives.buckets([p.local_numel("grad") for p in ps], bucket_numel):
                add(op, axes, count, sum(numel_of(ps[i]) for i in bucket) * itemsize)

    by_axes: dict[tuple[str, ...], list] = {}
    for p in mine:
        if p.data_axes["param"]:
            by_axes.setdefault(p.data_axes["param"], []).append(p)
    # ZeRO-3 / FSDP: per micro batch and piece, gathered, gathered again in the backward, over
    # the axes that shard them (one collective per piece and group: with ep, a block's experts
    # over their own data ranks); gradients reduce-scattered. The embedding's backward reads
    # no parameters unless the family says so (a lookup needs only the ids)
    # ``fp8_gathered`` weights travel in gathers of their own (one per piece and amax group),
    # one byte per element, after one all-reduce of their amaxes (fp32, over the ranks holding
    # their pieces: the data axes, and tp where it splits them) that the backward's gather reuses
    copy = DTYPE_BYTES[work.precision]
    for axes, gathered in sorted(by_axes.items()):
        kinds: dict[tuple[str, ...] | None, list] = {}  # amax axes (None: not in fp8) -> parameters
        for p in gathered:
            spread = set(axes) | ({"tp"} if p.tp_dim is not None else set())
            amax_axes = tuple(a for a in PHYSICAL_ORDER if a in spread) if p.path in fp8_gathered else None
            kinds.setdefault(amax_axes, []).append(p)
        for amax_axes, part in sorted(kinds.items(), key=lambda kv: kv[0] or ()):
            for kind, numel, count in _pieces(part, groups):
                again = embed_regathered if kind == "embed" else True
                if amax_axes is None:
                    add("all_gather", axes, n * (2 if again else 1), numel * copy)
                else:
                    add("all_gather_fp8", axes, n * (2 if again else 1), numel)
                    add("all_reduce", amax_axes, n, count * FP32)
                add("reduce_scatter", axes, n, numel * reduce)
    # ZeRO-2: the gradient's extra data axes, reduce-scattered per micro batch
    scheduled("reduce_scatter", lambda p: extra(p, "grad", "param"), lambda p: p.local_numel("param"), n, reduce)
    # ZeRO-1: onto the optimizer's shards, once per step
    scheduled("reduce_scatter", lambda p: extra(p, "opt", "grad"), lambda p: p.local_numel("grad"), 1, reduce)
    replicas = lambda p: p.replica_axes(tuple(a for a in DATA_AXES if mesh.size(a) > 1))  # noqa: E731
    if plan.strategy.flat:
        # the distributed optimizer: the replicas' sum reduce-scattered as flat buckets (per
        # micro batch with ZeRO-2), the updated ranges all-gathered (the few tensors whose
        # update reads them whole, MoE sign-rate biases, are all-reduced instead: not counted).
        # A whole-matrix optimizer's matrices travel in by-owner buckets of their own, each
        # rank's part padded to the most loaded rank's (``flat_optimizer.owner_packing``)
        per_step = n if plan.zero >= 2 else 1
        ranged = lambda p: () if p.path in matrices else replicas(p)  # noqa: E731
        scheduled("reduce_scatter", ranged, lambda p: p.local_numel("grad"), per_step, reduce)
        scheduled("all_gather", ranged, lambda p: p.local_numel("param"), 1, FP32)
        for axes, ps, world in _owner_buckets(plan, mine, matrices, bucket_numel):
            buffer = owner_buffer_numel([p.local_numel("grad") for p in ps], world)
            add("reduce_scatter", axes, per_step, buffer * reduce)
            add("all_gather", axes, 1, buffer * FP32)
        return
    # replicas (plain data parallelism, HSDP's dp): all-reduced once per step
    scheduled("all_reduce", replicas, lambda p: p.local_numel("opt"), 1, reduce)
    # ZeRO-1/2: the updated shards gathered back into every replica
    scheduled("all_gather", lambda p: extra(p, "opt", "param"), lambda p: p.local_numel("param"), 1, FP32)


def _full(p: Any) -> int:
    """Elements of a parameter on this rank once gathered over the data axes."""
    return p.local_numel("param") * p.data_split("param")


def _pieces(params: list, groups: tuple[tuple[str, ...], tuple[str, ...]]) -> list[tuple[str, int, int]]:
    """``(kind, gathered elements, parameters)`` per model piece, in order: the embedding
    group, each block, the head group (a tied embedding is gathered again with the head):
    ZeRO-3's buckets."""
    embed_groups, head_groups = groups
    pieces: dict[str, tuple[str, list]] = {}  # key -> (kind, its parameters), in order
    for p in params:
        top = p.path.split(".")[0]
        if p.path.startswith("blocks."):
            pieces.setdefault(".".join(p.path.split(".")[:2]), ("block", []))[1].append(p)
        elif not embed_groups and not head_groups:  # a model without the groups: its top-level names
            pieces.setdefault(top, ("other", []))[1].append(p)
    embed = [p for p in params if p.path.split(".")[0] in embed_groups]
    head = [p for p in params if p.path.split(".")[0] in head_groups]
    if not embed_groups and not head_groups:
        ordered = [v for k, v in pieces.items() if not k.startswith("blocks.")] + \
                  [v for k, v in pieces.items() if k.startswith("blocks.")]
    else:
        ordered = [("embed", embed), *(v for k, v in pieces.items()), ("head", head)]
    return [(kind, sum(_full(p) for p in ps), len(ps)) for kind, ps in ordered if ps]
