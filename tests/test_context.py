"""Context parallelism: the head-tail split of each sequence, balanced attention work, a
model that reads out-of-order chunks through explicit positions, and cp meshes that train
like one device (losses, gradient norms, every gradient, parameters)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxmega.config import ParallelConfig, override
from fxmega.core.errors import ConfigError
from fxmega.models import bert, gpt, llama, lm_loss_sum
from fxmega.ops.attention_blocks import attend_block, attend_block_backward, merge
from fxmega.ops.init import init_params
from fxmega.ops.layers import sdpa
from fxmega.parallel.context import attention_work, check_context_parallel, chunk_of, head_tail_order
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.parity import assert_matches_one_device, record
from tests.sharding_workers import tiny_config
from tests.tiers import E2E
from tests.tolerance import assert_within_rounding


def test_head_tail_order():
    # cp=2, 8 tokens: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert head_tail_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    batch = {"inputs": torch.arange(16).view(2, 8), "targets": torch.arange(16).view(2, 8) + 1}
    mine = chunk_of(batch, 1, 2)
    assert mine["inputs"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert mine["positions"].tolist() == [[2, 3, 4, 5]] * 2
    with pytest.raises(ConfigError, match="sequence length 12 does not split into 2 x cp = 8 equal chunks"):
        head_tail_order(12, 4)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_attention_work_is_equal_on_every_rank(cp):
    # the query-key pairs a causal mask allows, counted per rank: exactly equal under head-tail,
    # where contiguous chunks would give the last rank 2 cp - 1 times the first's
    work = attention_work(4096, cp)
    assert len(set(work)) == 1 and sum(work) == 4096 * 4097 // 2
    contiguous = [int((torch.arange(4096).view(cp, -1)[r] + 1).sum()) for r in range(cp)]
    assert contiguous[-1] / contiguous[0] > 2 * cp - 2


@pytest.mark.parametrize("module,name", [(gpt, "tiny_gpt"), (llama, "tiny_llama")])
@pytest.mark.parametrize("padded", [False, True])
def test_out_of_order_tokens_with_positions_give_the_same_loss(module, name, padded):
    """The whole model reads a sequence in head-tail order through explicit positions (the
    learned position table, the rotary tables and the causal mask come from them) and gives
    the in-order loss and gradients: what each cp rank relies on."""
    cfg = tiny_config(model=name).model
    params = init_params(module.param_specs(cfg), seed=0)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    batch = {"inputs": tokens, "targets": tokens.roll(-1, 1)}
    if padded:  # right padding: the second row's last 10 tokens
        valid = torch.ones(2, 32)
        valid[1, 22:] = 0
        batch |= {"attention_mask": valid, "loss_mask": valid}
    order = head_tail_order(32, 4)
    shuffled = {k: v[:, order] for k, v in batch.items()} | {"positions": order.expand(2, -1)}
    leaves = [p.requires_grad_(True) for p in torch.utils._pytree.tree_leaves(params)]
    want = lm_loss_sum(params, batch, cfg)
    want_grads = torch.autograd.grad(want, leaves)
    got = lm_loss_sum(params, shuffled, cfg)
    got_grads = torch.autograd.grad(got, leaves)
    # per token and block: d_model, the MLP width and the 32 keys of attention; then the
    # vocabulary; summed over the 64 tokens. The largest gradient entry bounds every entry.
    ffn = getattr(cfg, "ffn_dim", 0) or cfg.d_ff
    lengths = (cfg.n_layers * (cfg.d_model + ffn + 32), cfg.d_model + cfg.vocab_size, 64)
    assert_within_rounding(got, want, lengths, what="loss")
    scale = max(float(w.abs().max()) for w in want_grads)
    for g, w in zip(got_grads, want_grads):
        assert_within_rounding(g, w, lengths, scale=scale, what="gradient")
    in_order_mask = lm_loss_sum(params, {k: v[:, order] for k, v in batch.items()}, cfg)
    # without the positions the order matters: the check above is not vacuous
    assert abs(float(in_order_mask.detach()) - float(want.detach())) > 1e-3


def test_refusals():
    cfg = tiny_config(model="tiny_gpt")
    for mesh, model, message in [("cp=2", bert.FAMILY, "the bert model does not take out-of-order positions")]:
        with pytest.raises(ConfigError, match=message):
            check_context_parallel(dataclasses.replace(cfg, parallel=ParallelConfig(mesh=mesh)),
                                   MeshSpec.parse(mesh), model)
    a2a = override(tiny_config(model="tiny_llama"), ["parallel.mesh=cp=4", "parallel.cp_attention=a2a",
                                                     "train.seq_len=64"])
    with pytest.raises(ConfigError, match="a2a splits the attention heads over cp x tp = 4 ranks, but the model has "
                                          "2 kv heads"):
        check_context_parallel(a2a, MeshSpec.parse("cp=4"), llama.FAMILY)
    with pytest.raises(ConfigError, match="cp_attention='zigzag': use one of allgather, ring, a2a"):
        override(cfg, ["parallel.cp_attention=zigzag"]).validate()
    odd = override(cfg, ["train.seq_len=20", "parallel.mesh=cp=4"])
    with pytest.raises(ConfigError, match="sequence length 20 does not split into 2 x cp = 8"):
        check_context_parallel(odd, MeshSpec.parse("cp=4"), gpt.FAMILY)
    assert MeshSpec.parse("2x1x1x2").size("cp") == 2  # the positional form's fourth size


@pytest.mark.parametrize("fused, v_width", [(True, 5), (False, 5), (None, 3)])
def test_attention_blocks_merge_to_whole_attention(fused, v_width):
    """Ring attention's algebra on one process, in float64: attention over keys in blocks,
    merged by log-sum-exp, equals attention over all keys (causal and not, grouped heads),
    and each block's backward from the merged output and log-sum-exp sums to the gradients;
    with the CPU's fused kernel and written out, and with values narrower than queries and
    keys (MLA's), which the default takes to the written-out form (the fused kernel refuses
    them)."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 4, 5, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 8, 2, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 8, 2, v_width, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 8, 4, v_width, dtype=torch.float64)
    if v_width != 5:
        with pytest.raises(ValueError, match="values as wide as queries"):
            attend_block(q, k, v, fused=True)
    for causal in (False, True):
        want = sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        want_grads = torch.autograd.grad(want, (q, k, v), grad)
        if causal:  # the own chunks: one causal block
            out, lse = attend_block(q, k, v, causal=True, fused=fused)
            got_grads = attend_block_backward(q, k, v, grad, out, lse, causal=True, fused=fused)
        else:  # keys in two blocks of 3 and 5
            out, lse = merge(*attend_block(q, k[:, :3], v[:, :3], fused=fused),
                             *attend_block(q, k[:, 3:], v[:, 3:], fused=fused))
            first = attend_block_backward(q, k[:, :3], v[:, :3], grad, out, lse, fused=fused)
            second = attend_block_backward(q, k[:, 3:], v[:, 3:], grad, out, lse, fused=fused)
            got_grads = (first[0] + second[0], torch.cat([first[1], second[1]], 1), torch.cat([first[2], second[2]], 1))
        # float64: eps 2.2e-16 x (8 keys + 5 head dims) per entry x values of order 10 is
        # about 3e-14, which 1e-12 bounds on any CPU's summation order
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


# ---- cp meshes equal one device -------------------------------------------------------------
# name -> (model, parallel settings, ranks); sequence 256 (the tiny models' 64 positions
# raised to it: 2 x cp chunks of 32 tokens or more), global batch of 4 in micro batches of 2
CP_RUNS = {
    # each attention mode on cp=2, GPT and Llama (grouped-query attention)
    "gpt_cp2": ("tiny_gpt", dict(mesh="cp=2"), 2),
    "llama_cp2": ("tiny_llama", dict(mesh="cp=2"), 2),
    # all-to-all (Ulysses): the tiny GPT's 4 heads and the tiny Llama's 2 kv heads over cp=2
    "gpt_cp2_a2a": ("tiny_gpt", dict(mesh="cp=2", cp_attention="a2a"), 2),
    "llama_cp2_a2a": ("tiny_llama", dict(mesh="cp=2", cp_attention="a2a"), 2),
    # ring: keys and values passed around cp, block attention merged by log-sum-exp
    "gpt_cp2_ring": ("tiny_gpt", dict(mesh="cp=2", cp_attention="ring"), 2),
    # long-context memory: full recompute and the chunked loss on each rank's chunks
    "llama_cp2_ring_recompute_chunked": ("tiny_llama", dict(mesh="cp=2", cp_attention="ring"), 2,
                                         ("compute.recompute=full", "compute.loss_chunk=64")),
    "gpt_cp2_recompute": ("tiny_gpt", dict(mesh="cp=2"), 2, ("compute.recompute=selective",)),  # eager, below
    # cp=4 in every mode: all-gather and ring (Llama), a2a (GPT: its 4 heads over 4 ranks)
    "llama_cp4": ("tiny_llama", dict(mesh="cp=4"), 4),
    "llama_cp4_ring": ("tiny_llama", dict(mesh="cp=4", cp_attention="ring"), 4),
    "gpt_cp4_a2a": ("tiny_gpt", dict(mesh="cp=4", cp_attention="a2a"), 4),
    # composed with the other axes on 4 ranks: dp, fsdp, tp + sp (each attention mode), pp
    "gpt_cp2_dp2": ("tiny_gpt", dict(mesh="dp=2,cp=2"), 4),
    "gpt_cp2_fsdp2": ("tiny_gpt", dict(mesh="fsdp=2,cp=2", rules="fsdp"), 4),
    "llama_cp2_tp2_sp": ("tiny_llama", dict(mesh="cp=2,tp=2", sequence_parallel=True), 4),
    "gpt_cp2_tp2_a2a": ("tiny_gpt", dict(mesh="cp=2,tp=2", cp_attention="a2a"), 4),  # 4 heads over cp x tp
    "llama_cp2_tp2_ring": ("tiny_llama", dict(mesh="cp=2,tp=2", sequence_parallel=True, cp_attention="ring"), 4),
    # pipeline stages: positions go to every stage, each stage's gradients summed over cp
    "gpt_cp2_pp2": ("tiny_gpt", dict(mesh="pp=2,cp=2"), 4),
}
# Left out to keep the suite short, each covered by the runs above: ZeRO-3 next to cp (the
# fsdp run gathers parameters the same way), a2a with dp and ring with pp (the data and
# pipeline axes do not see the attention mode), the GPT on cp=4 with all-gather (the Llama's).
CP_STEPS = 2  # step 1's gradients, and the parameters after step 2
LONG = ("train.seq_len=256", "model.max_seq_len=256", "train.global_batch_size=4", "train.micro_batch_size=2")


# Compiled with inductor (fused C++ kernels): ring attention on cp=2, the mode with the most
# of its own (the blocks' log-sum-exp merge, their backward). Traced with aot_eager:
# all-gather and all-to-all attention, so every mode is traced once, and full recompute of
# the ring (recompute traced inside the forward's layout). The rest eager: the same ops and
# collectives without tracing the step on every rank (two cores, four ranks: the traces
# were most of this file's 6.5 minutes) — among them selective recompute on cp=2 and fsdp's
# checkpoint around cp attention, which recompute in the backward under the forward's
# activation layout (``recompute.in_forward_context``; before it, eager recompute ran
# unsharded attention and torch.utils.checkpoint refused the result).
# Under make test the ring traces with aot_eager too (tests/tiers.py): the user-path matrix's
# cp_ring case builds inductor's kernels for it through run.py.
INDUCTOR_RUNS = ("gpt_cp2_ring",) if E2E else ()
AOT_EAGER_RUNS = ("gpt_cp2", "gpt_cp2_a2a", "llama_cp2_ring_recompute_chunked", *(() if E2E else ("gpt_cp2_ring",)))


def _cp_config(model: str, parallel: dict | None = None, inductor: bool = False, compute: tuple = (),
               aot_eager: bool = False):
    backend = ("train.compile_backend=aot_eager",) if aot_eager else ()
    return tiny_config(parallel, model=model, compile=inductor or aot_eager, extra=(*LONG, *backend, *compute))


def cp_runs(names: list[str]) -> dict | None:
    from tests.sharding_workers import train

    def config(name: str):
        model, parallel, _, *compute = CP_RUNS[name]
        return _cp_config(model, parallel, name in INDUCTOR_RUNS, *compute, aot_eager=name in AOT_EAGER_RUNS)

    out = {name: train(config(name), CP_STEPS, collectives=False)[1] for name in names}
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope="module")
def references() -> dict:
    return {model: record(Run(_cp_config(model)), CP_STEPS) for model in ("tiny_gpt", "tiny_llama")}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_cp_meshes_match_one_device(ranks, references):
    names = [name for name, (_, _, n, *_) in CP_RUNS.items() if n == ranks]
    got = run_ranks(ranks, "tests.test_context:cp_runs", names)[0]
    for name in names:
        model = CP_RUNS[name][0]
        assert_matches_one_device(got[name], references[model], _cp_config(model), name)

