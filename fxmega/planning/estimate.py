"""What a step costs each rank in memory, by kind, from the plan alone. Pure arithmetic
over the plan and the run config (no process group, no tensors), so it prices a 1,024-rank
mesh in milliseconds; ``fxmega.planning.auto`` ranks hundreds of candidate meshes with it.

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

What a step sends is ``fxmega.planning.traffic``, over the shapes this module reads off
the plan (``block_shapes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fxmega.config import RunConfig
from fxmega.core.errors import ConfigError
from fxmega.models import family_name, model_for
from fxmega.models.census import Saved
from fxmega.models.family import ModelConfig
from fxmega.sharding.mesh import MeshSpec
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


def workload_of(cfg: RunConfig, data_size: int) -> Workload:
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


# -- activations of one block -------------------------------------------------------------
# which kinds of saved tensor (``fxmega.models.census``) each recompute mode keeps
KEPT = {"none": ("input", "autograd_input", "matmul", "attention", "norm_out", "other", "gathered", "combined"),
        "selective": ("input", "region_input", "matmul", "attention", "projection_out", "combined"),
        "full": ("input", "region_input", "attention")}
EAGER_ONLY = ("norm_out", "gathered")  # the compiled whole step recomputes or fuses them (below)
COMPILED_ONLY = ("combined",)  # without recompute, eager autograd keeps a gathered copy instead


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
    skip = EAGER_ONLY if compiled else COMPILED_ONLY if mode == "none" else ()
    return sum(_size(e, b) for e in saved.values() if e[2] in keep and e[2] not in skip)


def declares_saved(model_cfg: ModelConfig) -> bool:
    """Whether the family says what its blocks keep, which the memory estimate needs."""
    model = model_for(model_cfg)
    return model.block_saved is not None


def block_shape(plan: ShardingPlan, model_cfg: ModelConfig, tokens: int, index: int = 0,
                seq_len: int = 0) -> BlockShape:
    """The local sizes of block ``index`` on a rank of ``plan``, read off its parameters by
    their logical axes (tp splits heads, kv heads and mlp where the rules say so), and what
    the family says it keeps (``BLOCK_SAVED``, or ``block_saved(cfg, index, seq_len, ep)``
    where blocks differ: dense and MoE blocks, dispatch buffers sized by the sequence)."""
    prefix = f"blocks.{index}."
    return _shape_of(plan, model_cfg, tokens, index, seq_len,
                     [lay for lay in plan.params.values() if lay.path.startswith(prefix)])


def _shape_of(plan: ShardingPlan, model_cfg: ModelConfig, tokens: int, index: int, seq_len: int,
              layouts: list) -> BlockShape:
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
    if model.block_saved is None:
        raise ConfigError(f"the {family_name(model_cfg)} family declares no block_saved (what one block keeps for its "
                          f"backward, fxmega.models.census), which the memory estimate needs: `run.py summary` counts "
                          f"its parameters")
    saved = model.block_saved(model_cfg, index, seq_len, plan.mesh.size("ep"))
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


def memory(plan: ShardingPlan, model_cfg: ModelConfig, work: Workload) -> list[MemoryEstimate]:
    """A ``MemoryEstimate`` per pp rank (one without pipeline parallelism)."""
    act = work.act_bytes
    shapes = block_shapes(plan, model_cfg, work)
    shape = first_shape(plan, model_cfg, work, shapes)
    vocab_local = plan.padded_vocab_size // (plan.tp if vocab_split(plan) else 1)
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
                for i in blocks for m in {"none", recompute_mode(work, i)}}
        saved = (sum(kept[i, recompute_mode(work, i)] for i in blocks)
                 + len(blocks) * _cp_attention_bytes(shape, work, act))
        has_head = plan.pipeline is None or any(s.head for s in plan.pipeline.stages_of(r))
        flight = in_flight(plan, r, work.n_micro)
        t = work.tokens
        head_saved = head_transient = 0
        if has_head:
            logits_tokens = min(t, work.loss_chunk) if work.loss_chunk else t
            head_saved = 2 * t * shape.embed * act // shape.seq_split + logits_tokens * vocab_local * FP32
            head_transient = 2 * logits_tokens * vocab_local * FP32 + logits_tokens * vocab_local * act
        # one block's backward: what it recomputes, plus the gradients flowing through it
        block_transient = max((kept[i, "none"] - kept[i, recompute_mode(work, i)] + _gradients_through(shapes[i], act)
                               for i in blocks), default=0)
        if gathers:  # the gathered block's full gradients before their reduce-scatter
            block_transient += block_params * FP32
        out.append(MemoryEstimate(r, state["param"], state["grad"], state["opt"], copy,
                                  int(saved * flight + head_saved * (flight if plan.pipeline else 1)),
                                  int(max(head_transient, block_transient)), len(blocks), flight,
                                  max((block_bytes(shapes[i], act, work.recompute, joint) for i in blocks),
                                      default=0)))
    return out


def block_shapes(plan: ShardingPlan, model_cfg: ModelConfig, work: Workload) -> dict[int, BlockShape]:
    """``block_shape`` of every block, reading the plan's parameters once."""
    by_block: dict[int, list] = {}
    for lay in plan.params.values():
        if lay.path.startswith("blocks."):
            by_block.setdefault(int(lay.path.split(".")[1]), []).append(lay)
    return {i: _shape_of(plan, model_cfg, work.tokens, i, work.seq_len, lays) for i, lays in sorted(by_block.items())}


def saved_count(shape: BlockShape, name: str) -> float:
    """The per-token count of the family's saved tensor ``name`` (0 where the block has none):
    how a MoE block's table says how many rows its experts run (``moe.gate``), how many rows
    its buffers hold (``moe.buffers``) and how many experts each token picks
    (``moe.topk_indices``)."""
    return next((s.count for s in shape.saved if s.name == name), 0)


def first_shape(plan: ShardingPlan, model_cfg: ModelConfig, work: Workload, shapes: dict[int,
                BlockShape]) -> BlockShape:
    """The first block's shape (a model without blocks: what its first block would be)."""
    return shapes[min(shapes)] if shapes else block_shape(plan, model_cfg, work.tokens)


def _gradients_through(shape: BlockShape, act: int) -> int:
    """The gradients one block's backward holds at once: the residual stream's two and its
    feed-forward's hidden gradient (a MoE block's: over the rows its experts run)."""
    ffn = shape.mlp
    if shape.experts:
        ffn = saved_count(shape, "moe.gate") * (shape.embed + shape.expert_mlp) + shape.shared_mlp
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


def recompute_mode(work: Workload, index: int) -> str:
    """The recompute mode of block ``index`` (``recompute_layers`` limits it to the first ones)."""
    first_n = work.recompute_layers
    return work.recompute if (first_n == 0 or index < first_n) else "none"


def vocab_split(plan: ShardingPlan) -> bool:
    """Whether tp splits the vocabulary (the embedding and head are vocab-parallel)."""
    return any(lay.tp_dim is not None and lay.axes[lay.tp_dim] == "vocab" for lay in plan.params.values())


def _block_param_numel(plan: ShardingPlan, index: int) -> int:
    """Elements of block ``index`` on a rank once gathered over the data axes (tp-local)."""
    prefix = f"blocks.{index}."
    return sum(math.prod(p.shape) // (p.tp_size if p.tp_dim is not None else 1)
               for p in plan.params.values() if p.path.startswith(prefix))
