"""What a step costs each rank, from the plan alone: memory by kind and communication by
mesh axis. Pure arithmetic over the plan and the run config (no process group, no tensors),
so it prices a 1,024-rank mesh in milliseconds; ``fxmega.planning.auto`` ranks hundreds of
candidate meshes with it.

Memory on a rank (pp rank ``r``):
  parameters   fp32 masters, this rank's shards (exact: the plan's local shapes)
  gradients    fp32, in the gradient layout (ZeRO-2/3: sharded over dp): the accumulation
               buffers kept between micro batches (exact); with one micro batch the same
               bytes, counted for the gradients the backward produces.
  optimizer    AdamW's two moments, fp32, in the optimizer layout (ZeRO-1+); exact.
  compute copy bf16/fp16 casts of the weights, read by the forward and kept for the backward
               (ZeRO-3: one gathered block at a time).
  activations  what autograd keeps for the backward, per block per micro batch, times the
               micro batches the schedule keeps in flight (below), plus the head's.
  transient    the largest short-lived set: the loss's backward over the logits, or one
               block's backward (recomputed activations and the gradients flowing through).

Per-block activations count the tensors fxmega's own blocks save (``saved_tensors`` names
each one); tests/test_plan_scale.py checks them against the tensors autograd really saves,
tests/test_estimate.py and tests/test_recompute.py the totals against the measured peak of
compiled CPU steps.

Micro batches in flight on pp rank r (n micro batches per step): no pipeline 1; GPipe n;
1F1B min(pp - r, n); interleaved-1F1B min(2(pp - r - 1) + (v - 1) pp + 1, n v) stage chunks
of L/(pp v) blocks (Megatron's warm-up count); zero-bubble like interleaved.

Communication per step, bytes each rank sends (ring algorithms: all-reduce 2(W-1)/W of the
buffer, all-gather and reduce-scatter (W-1)/W of the full buffer), per mesh axis:
  tp    Megatron's f/g operators: per block two all-reduces forward and two backward of the
        [tokens, embed] activations (sequence parallel: all-gathers and reduce-scatters of
        the same total); full recompute repeats the forward's; the embedding, the head and
        the vocab-parallel cross-entropy add a few more.
  data  gradient all-reduce (ZeRO-0), reduce-scatter + parameter all-gather (ZeRO-1/2),
        ZeRO-3's gathers of every piece in the forward and again in the backward, and
        reduce-scatter of its gradients, per micro batch.
  pp    each stage boundary sends activations forward and gradients back per micro batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fxmega.core.errors import ConfigError
from fxmega.models import family_name, model_for
from fxmega.models.census import Saved
from fxmega.sharding import collectives
from fxmega.sharding.mesh import DATA_AXES, MeshSpec
from fxmega.sharding.plan import ShardingPlan

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4


@dataclass(frozen=True)
class Workload:
    """What one step computes on one data rank."""

    micro_batch: int  # sequences per micro batch
    seq_len: int
    n_micro: int  # micro batches per step on each data rank
    precision: str = "fp32"
    recompute: str = "none"
    recompute_layers: int = 0  # 0: every block as ``recompute`` says
    grad_reduce: str = "fp32"
    loss_chunk: int = 0
    cp: int = 1  # context-parallel ranks: each holds 1/cp of every sequence
    cp_attention: str = "allgather"

    @property
    def tokens(self) -> int:
        """Tokens of one micro batch on one rank (its cp share)."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.precision]


def workload_of(cfg: Any, data_size: int) -> Workload:
    """The ``Workload`` of a ``RunConfig`` on a mesh with ``data_size`` data ranks."""
    t, c = cfg.train, cfg.compute
    return Workload(t.micro_batch_size, t.seq_len, max(1, cfg.grad_accum_steps(data_size)), c.precision,
                    c.recompute, c.recompute_layers, c.grad_reduce, c.loss_chunk,
                    MeshSpec.parse(cfg.parallel.mesh).size("cp"), cfg.parallel.cp_attention)


@dataclass
class MemoryEstimate:
    pp_rank: int
    params: int
    grads: int
    opt: int
    compute_copy: int
    activations: int
    transient: int
    blocks: int  # blocks held by this rank
    in_flight: float  # micro batches (or stage chunks) whose activations are kept at once
    per_block: int  # saved activation bytes of one block for one micro batch

    @property
    def state(self) -> int:
        return self.params + self.grads + self.opt

    @property
    def total(self) -> int:
        return self.state + self.compute_copy + self.activations + self.transient


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


# -- activations of one block -------------------------------------------------------------
# which kinds of saved tensor (``fxmega.models.census``) each recompute mode keeps
KEPT = {"none": ("input", "autograd_input", "matmul", "attention", "norm_out", "other", "gathered", "combined"),
        "selective": ("input", "region_input", "matmul", "attention", "projection_out", "combined"),
        "full": ("input", "region_input", "attention")}
EAGER_ONLY = ("norm_out", "gathered")  # the compiled whole step recomputes or fuses them (below)
COMPILED_ONLY = ("combined",)


@dataclass(frozen=True)
class BlockShape:
    """The tensor sizes one rank's block works on (tp-local heads and mlp), and what the
    family says the block keeps for its backward."""

    saved: tuple[Saved, ...]  # the family's BLOCK_SAVED
    tokens: int  # micro batch x sequence
    embed: int
    heads: int  # local query heads
    kv_heads: int  # local key/value heads
    head_dim: int
    mlp: int  # local hidden width of the MLP
    seq_split: int  # 1, or tp under sequence parallelism (the residual stream is split)
    experts: int = 0  # a MoE block: the router's outputs
    expert_mlp: int = 0  # ... a routed expert's local hidden width
    shared_mlp: int = 0  # ... the shared experts' local hidden width


def saved_tensors(b: BlockShape, act: int) -> dict[str, tuple[int, bool, str]]:
    """Every tensor the backward of one block keeps: name -> (bytes, on the residual side
    (split along seq under sequence parallelism), kind), from the family's ``BLOCK_SAVED``
    (``fxmega.models.census`` says what the widths and kinds mean)."""
    widths = {"embed": b.embed, "q": b.heads * b.head_dim, "kv": b.kv_heads * b.head_dim, "mlp": b.mlp,
              "heads": b.heads, "one": 1, "experts": b.experts, "expert_mlp": b.expert_mlp,
              "shared_mlp": b.shared_mlp}
    dtypes = {"act": act, "fp32": FP32, "fp32_copy": FP32 if act < FP32 else 0, "int64": 8, "bool": 1}
    return {s.name: (round(b.tokens * s.count * widths[s.width] * dtypes[s.dtype]), s.residual, s.kind)
            for s in b.saved}


def _size(entry: tuple[int, bool, str], b: BlockShape) -> int:
    n, residual_side, _ = entry
    return n // b.seq_split if residual_side else n


def block_bytes(b: BlockShape, act: int, mode: str, compiled: bool = True) -> int:
    """Bytes one block keeps for its backward, per micro batch, under recompute ``mode``:
    none keeps what autograd saves; selective the block input, the matmul outputs (the
    output projections' too) and the attention outputs; full the input and the attention
    outputs (see fxmega.ops.recompute).

    ``compiled``: fxmega's whole-step graph does not keep the norms' outputs, which eager
    autograd does: measured on CPU (inductor, tests/test_estimate.py), a GPT block adds 14.1
    units of [tokens, embed] to the step's peak where eager autograd saves 16.1 — the two norm
    outputs, recomputed from the kept input and statistics. Pipeline stages, compiled as
    separate forward and backward graphs, keep them (measured on pp=2: 8.1 MiB per block
    and micro batch, eager's count). Likewise a MoE block's gathered copies (the pairs' rows
    taken from the tokens and from the experts' outputs): inductor fuses the gathers into
    the kernels that read them and keeps the experts' outputs instead (``combined``),
    measured on the tiny MoE: 6 units of [rows, d] per buffered row (buffers, gate, up,
    activation, hidden, outputs), nothing per pair beyond the indices."""
    saved = saved_tensors(b, act)
    keep = KEPT[mode]
    skip = EAGER_ONLY if compiled else COMPILED_ONLY
    return sum(_size(e, b) for e in saved.values() if e[2] in keep and e[2] not in skip)


def declares_saved(model_cfg: Any) -> bool:
    """Whether the family says what its blocks keep, which the memory estimate needs."""
    model = model_for(model_cfg)
    return hasattr(model, "block_saved") or getattr(model, "BLOCK_SAVED", None) is not None


def block_shape(plan: ShardingPlan, model_cfg: Any, tokens: int, index: int = 0, seq_len: int = 0) -> BlockShape:
    """The local sizes of block ``index`` on a rank of ``plan``, read off its parameters by
    their logical axes (tp splits heads, kv heads and mlp where the rules say so), and what
    the family says it keeps (``BLOCK_SAVED``, or ``block_saved(cfg, index, seq_len, ep)``
    where blocks differ: dense and MoE blocks, dispatch buffers sized by the sequence)."""
    prefix = f"blocks.{index}."
    return _shape_of(plan, model_cfg, tokens, index, seq_len,
                     [lay for lay in plan.params.values() if lay.path.startswith(prefix)])


def _shape_of(plan: ShardingPlan, model_cfg: Any, tokens: int, index: int, seq_len: int, layouts: list) -> BlockShape:
    sizes: dict[str, int] = {}
    moe: dict[str, int] = {}
    prefix = f"blocks.{index}."
    for lay in layouts:
        local = [n // (lay.tp_size if lay.tp_dim == dim else 1) for dim, n in enumerate(lay.shape)]
        name = lay.path[len(prefix):]
        if name.startswith("moe."):  # the experts' widths, apart from the dense MLP's
            moe[name] = local[-1]
            continue
        for dim, axis in enumerate(lay.axes):
            sizes[axis] = min(sizes.get(axis, local[dim]), local[dim])
    model = model_for(model_cfg)
    if hasattr(model, "block_saved"):
        saved = model.block_saved(model_cfg, index, seq_len, plan.mesh.size("ep"))
    else:
        saved = getattr(model, "BLOCK_SAVED", None)
    if saved is None:
        raise ConfigError(f"the {family_name(model_cfg)} family declares no BLOCK_SAVED (what one block keeps for its "
                          f"backward, fxmega.models.census), which the memory estimate needs: `run.py summary` counts "
                          f"its parameters")
    heads = sizes.get("heads", model_cfg.n_heads)
    return BlockShape(tuple(saved), tokens, model_cfg.d_model, heads, sizes.get("kv_heads", heads),
                      sizes.get("head_dim", model_cfg.d_model // model_cfg.n_heads), sizes.get("mlp", 0),
                      plan.tp if plan.sequence_parallel else 1, moe.get("moe.router", 0),
                      moe.get("moe.w_gate", 0), moe.get("moe.shared.w_gate", 0))


# -- the whole rank -------------------------------------------------------------------
def in_flight(plan: ShardingPlan, pp_rank: int, n_micro: int) -> float:
    """Micro batches of a whole stage set kept at once on ``pp_rank`` (see module docstring),
    as a multiple of the rank's blocks' activations for one micro batch."""
    pipe = plan.pipeline
    if pipe is None:
        return 1.0
    pp, v = pipe.pp, pipe.virtual
    if pipe.schedule == "gpipe":
        return float(n_micro)
    if pipe.schedule == "1f1b":
        return float(min(pp - pp_rank, n_micro))
    chunks = min(2 * (pp - pp_rank - 1) + (v - 1) * pp + 1, n_micro * v)
    return chunks / v


def memory(plan: ShardingPlan, model_cfg: Any, work: Workload) -> list[MemoryEstimate]:
    """A ``MemoryEstimate`` per pp rank (one without pipeline parallelism)."""
    act = work.act_bytes
    shapes = block_shapes(plan, model_cfg, work)
    shape = shapes[min(shapes)] if shapes else block_shape(plan, model_cfg, work.tokens)
    vocab_local = plan.padded_vocab_size // (plan.tp if _vocab_split(plan) else 1)
    out = []
    for r in range(plan.mesh.size("pp")):
        mine = [p for p in plan.params.values() if r in plan.pp_owners(p.path)]
        state = plan.bytes_per_rank(r)
        blocks = sorted({int(p.path.split(".")[1]) for p in mine if p.path.startswith("blocks.")})
        gathers = any(p.data_axes["param"] for p in mine)
        block_params = _block_param_numel(plan, blocks[0] if blocks else 0)
        if work.precision == "fp32":
            copy = block_params * FP32 if gathers else 0  # ZeRO-3: one gathered block
        else:
            local = sum(p.local_numel("param") for p in mine)
            copy = block_params * act if gathers else local * act
        # a pipeline stage is compiled as a forward graph and a backward graph (AOTAutograd's
        # split), which keep what eager autograd keeps; the whole-step graph keeps less
        joint = plan.pipeline is None
        kept = {(i, m): block_bytes(shapes[i], act, m, compiled=joint)
                for i in blocks for m in {"none", _mode(work, i)}}
        saved = sum(kept[i, _mode(work, i)] for i in blocks) + len(blocks) * _cp_attention_bytes(shape, work, act)
        has_head = plan.pipeline is None or any(s.head for s in plan.pipeline.stages_of(r))
        flight = in_flight(plan, r, work.n_micro)
        t = work.tokens
        head_saved = head_transient = 0
        if has_head:
            logits_tokens = min(t, work.loss_chunk) if work.loss_chunk else t
            head_saved = 2 * t * shape.embed * act // shape.seq_split + logits_tokens * vocab_local * FP32
            head_transient = 2 * logits_tokens * vocab_local * FP32 + logits_tokens * vocab_local * act
        # one block's backward: what it recomputes, plus the gradients flowing through it
        block_transient = max((kept[i, "none"] - kept[i, _mode(work, i)] + _gradients_through(shapes[i], act)
                               for i in blocks), default=0)
        if gathers:  # the gathered block's full gradients before their reduce-scatter
            block_transient += block_params * FP32
        out.append(MemoryEstimate(r, state["param"], state["grad"], state["opt"], copy,
                                  int(saved * flight + head_saved * (flight if plan.pipeline else 1)),
                                  int(max(head_transient, block_transient)), len(blocks), flight,
                                  max((block_bytes(shapes[i], act, work.recompute, joint) for i in blocks),
                                      default=0)))
    return out


def block_shapes(plan: ShardingPlan, model_cfg: Any, work: Workload) -> dict[int, BlockShape]:
    """``block_shape`` of every block, reading the plan's parameters once."""
    by_block: dict[int, list] = {}
    for lay in plan.params.values():
        if lay.path.startswith("blocks."):
            by_block.setdefault(int(lay.path.split(".")[1]), []).append(lay)
    return {i: _shape_of(plan, model_cfg, work.tokens, i, work.seq_len, lays) for i, lays in sorted(by_block.items())}


def _gradients_through(shape: BlockShape, act: int) -> int:
    """The gradients one block's backward holds at once: the residual stream's two and its
    feed-forward's hidden gradient (a MoE block's: over the rows its experts run)."""
    ffn = shape.mlp
    if shape.experts:
        rows = max((s.count for s in shape.saved if s.name == "moe.gate"), default=0)
        ffn = rows * (shape.embed + shape.expert_mlp) + shape.shared_mlp
    return int(shape.tokens * (2 * shape.embed + ffn) * act)


def _cp_attention_bytes(shape: BlockShape, work: Workload, act: int) -> int:
    """What a block's attention keeps under cp beyond its share of the tokens: the explicit
    boolean mask (queries x keys: the chunks are out of order, so no causal kernel), and with
    all-gather the gathered keys and values of the other ranks' chunks. The ring keeps
    nothing more (its output's log-sum-exp is what SDPA's kernels keep too)."""
    if work.cp == 1 or work.cp_attention == "ring":
        return 0
    queries = work.tokens if work.cp_attention == "allgather" else work.tokens * work.cp
    mask = queries * work.seq_len
    gathered = 2 * work.tokens * (work.cp - 1) * shape.kv_heads * shape.head_dim * act
    return mask + (gathered if work.cp_attention == "allgather" else 0)


def _mode(work: Workload, index: int) -> str:
    first_n = work.recompute_layers
    return work.recompute if (first_n == 0 or index < first_n) else "none"


def _vocab_split(plan: ShardingPlan) -> bool:
    return any(lay.tp_dim is not None and lay.axes[lay.tp_dim] == "vocab" for lay in plan.params.values())


def _block_param_numel(plan: ShardingPlan, index: int) -> int:
    """Elements of block ``index`` on a rank once gathered over the data axes (tp-local)."""
    prefix = f"blocks.{index}."
    return sum(math.prod(p.shape) // (p.tp_size if p.tp_dim is not None else 1)
               for p in plan.params.values() if p.path.startswith(prefix))


# -- communication ---------------------------------------------------------------------
def communication(plan: ShardingPlan, model_cfg: Any, work: Workload,
                  bucket_numel: int = 40_000_000, pp_rank: int = 0) -> dict[str, AxisTraffic]:
    """Bytes each rank of pp rank ``pp_rank`` sends per step, and collectives, per mesh axis."""
    mesh, act = plan.mesh, work.act_bytes
    traffic: dict[str, AxisTraffic] = {}
    shapes = block_shapes(plan, model_cfg, work)
    shape = shapes[min(shapes)] if shapes else block_shape(plan, model_cfg, work.tokens)
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
                      embed_backward_reads_params(model_cfg))
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
    meshes, tests/test_plan_scale.py). Attention, per block: all-gather reaches the other
    chunks' keys and values and their positions in the forward (again in a recomputed
    forward) and reduce-scatters the keys' and values' gradients; all-to-all (Ulysses)
    exchanges q, k and v for head groups and the output back, forward and backward, and
    gathers the positions; the ring passes k and v (and in the backward their gradients) to
    the next rank, one chunk pair per step. Every parameter's gradient (a partial sum over
    the rank's chunks) is all-reduced over cp, in fp32, once per micro batch."""
    cp, n, act = work.cp, work.n_micro, work.act_bytes
    kv_full = work.tokens * cp * shape.kv_heads * shape.head_dim * act
    q_local = work.tokens * shape.heads * shape.head_dim * act
    kv_local = work.tokens * shape.kv_heads * shape.head_dim * act
    positions_full = work.tokens * cp * 8  # int64
    forwards = len(blocks) + sum(1 for i in blocks if _mode(work, i) == "full")
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
        out.add("all_gather", forwards * n, positions_full, cp)
        out.add("all_gather", 2 * forwards * n, kv_full, cp)
        out.add("reduce_scatter", 2 * len(blocks) * n, kv_full, cp)
    else:
        out.add("all_gather", forwards * n, positions_full, cp)
        per_block = 2 * q_local + 2 * kv_local  # q, the output, k, v of this rank's tokens
        out.add("all_to_all", 4 * (forwards + len(blocks)) * n, per_block / 4, cp)
    for p in mine:
        out.add("all_reduce", n, p.local_numel("param") * FP32, cp)


def _pairs(b: BlockShape) -> float:
    """(token, expert) pairs per token of a MoE block: its router's top k."""
    return max((s.count for s in b.saved if s.name == "moe.topk_indices"), default=0)


def _ep_traffic(work: Workload, shapes: dict[int, BlockShape], blocks: list[int], ep: int,
                out: AxisTraffic) -> None:
    """All-to-alls over ep, per MoE block and micro batch (``fxmega.ops.moe``): the expert
    buffers [E, sequences x rows, d] go to their experts' ranks and the outputs come back,
    forward and backward; a recomputed forward exchanges them again."""
    for i in blocks:
        b = shapes[i]
        rows = max((s.count for s in b.saved if s.name == "moe.buffers"), default=0)
        if not rows:
            continue
        buffers = b.tokens * rows * b.embed * work.act_bytes
        forwards = 2 if _mode(work, i) == "none" else 3
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
    shape = shapes[min(shapes)]
    tp, n, act = plan.tp, work.n_micro, work.act_bytes
    act_bytes = work.tokens * shape.embed * act
    full = [i for i in blocks if _mode(work, i) == "full"]
    has_head = plan.pipeline is None or any(s.head for s in plan.pipeline.stages_of(pp_rank))
    has_embed = plan.pipeline is None or any(s.embed for s in plan.pipeline.stages_of(pp_rank))
    moe = [shapes[i] for i in blocks if shapes[i].experts]
    for b in moe:  # the router's partial gradients (docstring)
        out.add("reduce_scatter", n, b.tokens * _pairs(b) * FP32, tp)
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
        redone = [i for i in blocks if _mode(work, i) != "none"]  # recompute redoes the forward's gathers
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
        if has_embed and _vocab_split(plan):
            out.add("all_reduce", n, act_bytes, tp)  # the vocab-parallel embedding's partial sums
        if has_head:
            out.add("all_reduce", n, act_bytes, tp)  # the head's input gradient
    if has_head:
        # vocab-parallel cross-entropy: max, sum of exp, target logit; then the loss's partial sum
        out.add("all_reduce", 3 * n, work.tokens * FP32, tp)
        out.add("all_reduce", n, FP32, tp)


def model_groups(model_cfg: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The model's embedding and head parameter groups (ZeRO-3 gathers each as one piece)."""
    model = model_for(model_cfg)
    return tuple(getattr(model, "EMBED_PARAMS", ())), tuple(getattr(model, "HEAD_PARAMS", ()))


def embed_backward_reads_params(model_cfg: Any) -> bool:
    """Whether the family's embedding needs its parameters in the backward (BERT's ends with
    a LayerNorm; a plain lookup plus positions does not), so ZeRO-3 gathers it again there."""
    return bool(getattr(model_for(model_cfg), "EMBED_BACKWARD_READS_PARAMS", False))


def _data_traffic(plan: ShardingPlan, mine: list, work: Workload, bucket_numel: int,
                  traffic: dict[str, AxisTraffic], groups: tuple[tuple[str, ...], tuple[str, ...]],
                  embed_regathered: bool) -> None:
    """The data axes' collectives, as ``Parallel`` schedules them: each op over the axes it
    spans (HSDP: gathers over fsdp, replica all-reduce over dp), bucketed the same way."""
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
    copy = DTYPE_BYTES[work.precision]
    for axes, gathered in sorted(by_axes.items()):
        for kind, numel in _pieces(gathered, groups):
            again = embed_regathered if kind == "embed" else True
            add("all_gather", axes, n * (2 if again else 1), numel * copy)
            add("reduce_scatter", axes, n, numel * reduce)
    # ZeRO-2: the gradient's extra data axes, reduce-scattered per micro batch
    scheduled("reduce_scatter", lambda p: extra(p, "grad", "param"), lambda p: p.local_numel("param"), n, reduce)
    # ZeRO-1: onto the optimizer's shards, once per step
    scheduled("reduce_scatter", lambda p: extra(p, "opt", "grad"), lambda p: p.local_numel("grad"), 1, reduce)
    # replicas (plain data parallelism, HSDP's dp): all-reduced once per step
    scheduled("all_reduce", lambda p: p.replica_axes(tuple(a for a in DATA_AXES if mesh.size(a) > 1)),
              lambda p: p.local_numel("opt"), 1, reduce)
    # ZeRO-1/2: the updated shards gathered back into every replica
    scheduled("all_gather", lambda p: extra(p, "opt", "param"), lambda p: p.local_numel("param"), 1, FP32)


def _full(p: Any) -> int:
    """Elements of a parameter on this rank once gathered over the data axes."""
    return p.local_numel("param") * p.data_split("param")


def _pieces(params: list, groups: tuple[tuple[str, ...], tuple[str, ...]]) -> list[tuple[str, int]]:
    """``(kind, gathered elements)`` per model piece, in order: the embedding group, each
    block, the head group (a tied embedding is gathered again with the head): ZeRO-3's
    buckets."""
    full = _full

    embed_groups, head_groups = groups
    blocks: dict[str, int] = {}
    for p in params:
        if p.path.startswith("blocks."):
            key = ".".join(p.path.split(".")[:2])
            blocks[key] = blocks.get(key, 0) + full(p)
    embed = sum(full(p) for p in params if p.path.split(".")[0] in embed_groups)
    head = sum(full(p) for p in params if p.path.split(".")[0] in head_groups)
    if not embed_groups and not head_groups:  # a model without the groups: its top-level names
        rest: dict[str, int] = {}
        for p in params:
            if not p.path.startswith("blocks."):
                rest[p.path.split(".")[0]] = rest.get(p.path.split(".")[0], 0) + full(p)
        return [("other", n) for n in rest.values()] + [("block", n) for n in blocks.values()]
    return [(k, n) for k, n in (("embed", embed), *(("block", b) for b in blocks.values()), ("head", head)) if n]
