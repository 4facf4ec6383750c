"""The mixture-of-experts family (``fxmega.models.mixtral``): published sizes, and a training
step whose gradient holds the balancing terms, weighted so that the run does not depend on
how the global batch is split into micro batches."""

from __future__ import annotations

import re
import unittest.mock

import pytest
import torch

from fxmega.config import load, override
from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.models import mixtral
from fxmega.ops import experts, moe, routing
from fxmega.parallel.activation_layouts import ActivationLayouts
from fxmega.planning.report import plan_report
from fxmega.planning.summary import summary
from fxmega.sharding.mesh import MeshSpec
from fxmega.sharding.plan import format_bytes
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.parity import assert_gradients_match, assert_matches_one_device, record
from tests.sharding_workers import ROOT, tiny_config, train
from tests.tolerance import assert_losses_match


@pytest.mark.parametrize("name,total,active", [
    ("mixtral_8x7b", 46.7e9, 12.9e9),  # Jiang et al. 2024, Section 2
    ("deepseek_moe_16b", 16.4e9, 2.8e9),  # Dai et al. 2024, DeepSeekMoE 16B
    ("qwen3_30b_a3b", 30.5e9, 3.3e9),  # Qwen3 technical report, Table 2
    ("qwen15_moe_a27b", 14.3e9, 2.7e9),  # Qwen1.5-MoE blog and model card
])
def test_published_sizes(name, total, active):
    cfg = load(ROOT / "configs" / f"{name}.py").model
    cfg.validate()
    got = sum(s.numel for s in tree.leaves(mixtral.param_specs(cfg)))
    # the papers print one decimal of billions, rounded, or (Qwen3's 3.35B active, printed
    # 3.3B) cut off: the count lies in [printed - 0.05, printed + 0.1)
    assert -0.05e9 <= got - total < 0.1e9 and -0.05e9 <= mixtral.active_params(cfg) - active < 0.1e9


def test_summary_shows_dense_and_expert_blocks_and_the_active_count():
    text = summary(load(ROOT / "configs" / "deepseek_moe_16b.py").model, seq_len=4096)
    assert "blocks 0-0 (1 x 84,021,248)" in text and "blocks 1-27 (27 x 587,862,016)" in text
    assert "shared.w_gate [2048, 2816]" in text  # the 2 shared experts as one MLP
    assert "parameters: 16,375,728,128" in text and "active per token: 2,828,650,496" in text


def _moe_config(*extra: str):
    return override(load(ROOT / "configs" / "tiny_moe.py"),
                    ["train.device=cpu", "train.compile_backend=aot_eager", "optim.clip_grad=100", *extra])


def test_micro_batches_do_not_change_the_run():
    """Balancing terms per sequence, scaled like the main loss: one micro batch of 8 and four
    of 2 give the same losses, gradient norms and first-step gradients; without the terms the
    gradient differs, so they are in it."""
    whole = _moe_config("train.micro_batch_size=8")  # compiled (aot_eager): the step's graph holds the terms
    split = _moe_config("train.micro_batch_size=2", "train.compile=false")  # eager: seconds, not a compile
    want = record(Run(whole), 2)
    got = record(Run(split), 2)
    assert_losses_match(got["losses"], want["losses"], whole, "loss")
    assert_losses_match(got["grad_norms"], want["grad_norms"], whole, "grad norm")
    assert_gradients_match(got["first_moment"], want["first_moment"], whole, "micro batches of 2")
    bare = record(Run(_moe_config("train.micro_batch_size=8", "train.compile=false", "model.moe.aux_loss_coeff=0",
                                  "model.moe.z_loss_coeff=0")), 1)
    router = "blocks.0.moe.router"
    diff = float((bare["first_moment"][router] - want["first_moment"][router]).abs().max())
    assert diff > 1e-4 * float(want["first_moment"][router].abs().max()), diff
    assert want["losses"][0] == pytest.approx(bare["losses"][0])  # the terms are in the gradient, not the loss


def test_capacity_mode_trains_and_matches_dropless_with_room():
    # capacity factor E / k: every expert can take every token of a sequence, so none is dropped
    roomy = record(Run(_moe_config("model.moe.capacity_factor=2.0", "train.compile=false")), 2)
    dropless = record(Run(_moe_config("train.compile=false")), 2)
    cfg = _moe_config()
    assert_losses_match(roomy["losses"], dropless["losses"], cfg, "loss")
    assert_gradients_match(roomy["first_moment"], dropless["first_moment"], cfg, "capacity 2.0")


def test_recompute_keeps_the_balancing_terms():
    """Full recompute re-runs each block in the backward: the terms ride on its output once,
    in one backward region (the compiled step's recompute pass refuses disjoint ones)."""
    cfg = _moe_config()
    plain = record(Run(_moe_config("train.compile=false")), 1)
    again = record(Run(_moe_config("compute.recompute=full")), 1)
    # eager, the recompute runs after the step has left its gradient scale: it is restored
    # (recompute.in_forward_context), or the block recomputes without its terms
    eager = record(Run(_moe_config("compute.recompute=full", "train.compile=false")), 1)
    for name, got in (("full recompute", again), ("full recompute, eager", eager)):
        assert_losses_match(got["grad_norms"], plain["grad_norms"], cfg, f"{name}: grad norm")
        assert_gradients_match(got["first_moment"], plain["first_moment"], cfg, name)


BIAS = ("model.moe.score=sigmoid", "model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01")


def test_expert_bias_moves_by_the_load_outside_adamw():
    """DeepSeek-V3's bias: zero at step 1, so the step's gradient norm is the bias-free run's
    (its load is not a gradient); then each entry moves by exactly +-rate or 0, the same
    whether the global batch's loads were counted in one micro batch or summed over four,
    AdamW leaves its moments at zero, and step 2 (routed with the bias) agrees too."""
    plain = record(Run(_moe_config(*BIAS[:1], "train.compile=false")), 1)
    whole = Run(_moe_config(*BIAS, "train.micro_batch_size=8"))  # compiled: the carried load in the graph
    split = Run(_moe_config(*BIAS, "train.micro_batch_size=2", "train.compile=false"))
    got, got_split = record(whole, 1), record(split, 1)
    cfg = _moe_config()
    assert_losses_match(got["grad_norms"], plain["grad_norms"], cfg, "grad norm with a zero bias")
    for i in range(2):
        bias = got["params"][f"blocks.{i}.moe.expert_bias"]
        # +-0.01 or 0; a sum of counts is exact in fp32, so both runs move it identically
        assert set((bias / 0.01).round().tolist()) <= {-1.0, 0.0, 1.0} and bias.abs().sum() > 0, bias
        assert torch.allclose(bias, (bias / 0.01).round() * 0.01, rtol=0, atol=1e-9)
        assert torch.equal(bias, got_split["params"][f"blocks.{i}.moe.expert_bias"])
        assert not whole.full_opt_state("exp_avg")["blocks"][i]["moe"]["expert_bias"].any()
    second, second_split = record(whole, 1), record(split, 1)
    assert_losses_match(second["losses"] + second["grad_norms"], second_split["losses"] + second_split["grad_norms"],
                        cfg, "step 2, routed with the bias")


def test_refusals():
    with pytest.raises(ConfigError, match="model.moe.n_experts=0: a model without experts is a llama"):
        _moe_config("model.moe.n_experts=0").validate()
    with pytest.raises(ConfigError, match="first_dense_layers=2 leaves none of the 2 layers"):
        _moe_config("model.moe.first_dense_layers=2").validate()
    with pytest.raises(ConfigError, match=r"--mesh cp=2 \(2 ranks\): the mixtral family does not split over cp yet"):
        mixtral.FAMILY.check_mesh(_moe_config("parallel.mesh=cp=2").model, MeshSpec.parse("cp=2"))


# ---- meshes equal one device -----------------------------------------------------------------
# name -> parallel settings on 2 ranks; the tiny MoE with its balancing terms, a sigmoid
# router with DeepSeek-V3's expert bias, a shared expert and a dense first block (DeepSeek's
# shape), Qwen3's attention (below), global batch 8 in micro batches of 4, compiled with
# aot_eager (the same graph and collectives as inductor)
MOE_RUNS = {
    "dp2": dict(mesh="dp=2"),  # each data rank its sequences: the terms summed over dp in the gradient
    "zero3": dict(mesh="dp=2", rules="zero3"),  # experts' weights sharded and gathered per block
    "pp2": dict(mesh="pp=2"),  # each stage injects its own blocks' terms
    # experts split along their hidden width (Megatron's expert tensor parallelism), routing
    # on the tp-replicated tokens; with sequence parallelism between blocks
    "tp2": dict(mesh="tp=2"),
    "tp2_sp": dict(mesh="tp=2", sequence_parallel=True),
}
MOE_STEPS = 2


# Qwen3's attention options on the same model: heads of width 8 (not 64 / 4) whose queries
# and keys are RMS-normalised, so tp and ep see them too
QWEN3_ATTENTION = ("model.qk_norm=true", "model.d_head=8")
# Qwen2-MoE's pieces: biases on q, k and v (split over tp with their heads) and a sigmoid
# gate on the shared experts' output (replicated; the gated output a partial sum under tp)
QWEN2_EXTRAS = ("model.qkv_bias=true", "model.moe.shared_gate=true")


def _mesh_config(parallel: dict | None = None):
    return tiny_config(parallel, model="tiny_moe", extra=("train.compile_backend=aot_eager", *BIAS,
                                                          "model.moe.n_shared_experts=1",
                                                          "model.moe.first_dense_layers=1", *QWEN3_ATTENTION))


def moe_runs(names: list[str]) -> dict | None:
    out = {name: train(_mesh_config(MOE_RUNS[name]), MOE_STEPS, collectives=False)[1] for name in names}
    return out if torch.distributed.get_rank() == 0 else None


def assert_router_stats_match(got: dict, want: dict, name: str) -> None:
    """A mesh's router statistics against one device's, step by step: sums of per-sequence
    and per-micro-batch values, the same groups of sequences on every mesh here (the data
    ranks' micro batches are one device's micro batches), added in other orders."""
    assert got["router"][0], f"{name}: no router statistics"
    for step, (g, w) in enumerate(zip(got["router"], want["router"])):
        assert set(g) == set(w) and w, (name, step)
        # fp32 sums of at most 16 terms in another order: 16 x 6e-8 relative, far below 1e-5
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (name, step, key)


@pytest.mark.slow
def test_moe_meshes_match_one_device():
    want = record(Run(_mesh_config()), MOE_STEPS)
    got = run_ranks(2, "tests.test_mixtral:moe_runs", list(MOE_RUNS))[0]
    for name in MOE_RUNS:
        assert_matches_one_device(got[name], want, _mesh_config(), name)
        assert_router_stats_match(got[name], want, name)


# ---- expert parallelism: ep folded over the data ranks ------------------------------------------
# name -> (ranks, parallel settings, model overrides); the mesh runs' model, global batch 8
# in micro batches of 2 (up to 4 data ranks)
EP_RUNS = {
    # dropless: each expert has room for every token of a sequence, runs on its own rank
    "ep2": (2, dict(mesh="dp=2,ep=2"), ()),
    # capacity 1.0 drops pairs: the same ones as on one device (buffers are per sequence)
    "ep2_capacity": (2, dict(mesh="dp=2,ep=2"), ("model.moe.capacity_factor=1.0",)),
    # ZeRO-1 over all 4 data ranks for dense state, over the 2 expert-data ranks for experts
    "ep2_zero1": (4, dict(mesh="dp=4,ep=2", rules="zero1"), ()),
    # ZeRO-3: a block gathers its dense weights over all 4 ranks and its experts over 2
    "ep2_zero3": (4, dict(mesh="dp=4,ep=2", rules="zero3"), ()),
    # ep folded over fsdp (torchtitan's): dense weights sharded over all 4 ranks, experts over 2
    "ep2_fsdp": (4, dict(mesh="fsdp=4,ep=2", rules="fsdp"), ()),
    "ep4": (4, dict(mesh="dp=4,ep=4"), ()),  # one expert per rank, room for the whole sequence
    "ep4_capacity": (4, dict(mesh="dp=4,ep=4"), ("model.moe.capacity_factor=1.0",)),  # one expert per rank
    "ep2_tp2": (4, dict(mesh="dp=2,ep=2,tp=2", sequence_parallel=True), ()),  # experts split over ep and tp
    "ep2_pp2": (4, dict(mesh="dp=2,ep=2,pp=2"), ()),  # each stage's experts over its own ep group
}


# Traced with aot_eager, the exchanges read from the graph: the 2-rank runs. The 4-rank ones
# eager (four ranks tracing the step on two cores were most of this test's two minutes),
# the exchanges recorded where the layouts choose their mesh axes.
EP_TRACED = ("ep2", "ep2_capacity")


def _ep_config(name: str | None = None, *extra: str, traced: bool = True):
    return tiny_config(None if name is None else EP_RUNS[name][1], model="tiny_moe",
                       extra=("train.compile_backend=aot_eager", *BIAS, "model.moe.n_shared_experts=1",
                              "model.moe.first_dense_layers=1", *QWEN3_ATTENTION, *QWEN2_EXTRAS,
                              "train.micro_batch_size=2", *extra, *(() if traced else ("train.compile=false",))))


def _eager_exchanges(cfg) -> tuple:
    """``train(cfg)`` eager, with the mesh axes of every all-to-all the layouts make."""
    exchanged: set[str] = set()
    choose = ActivationLayouts._exchange_axes

    def recording(self, name: str) -> tuple[str, ...]:
        axes = choose(self, name)
        if axes:
            exchanged.add(",".join(axes))
        return axes

    with unittest.mock.patch.object(ActivationLayouts, "_exchange_axes", recording):
        par, result, _ = train(cfg, MOE_STEPS, collectives=False)
    return par, result, exchanged


def ep_runs(names: list[str]) -> dict | None:
    out = {}
    for name in names:
        cfg = _ep_config(name, *EP_RUNS[name][2], traced=name in EP_TRACED)
        if name in EP_TRACED:
            par, result, collectives = train(cfg, MOE_STEPS, collectives=True)
            exchanged = {group for graph in collectives for op, group, *_ in graph if "all_to_all" in op}
        else:
            par, result, exchanged = _eager_exchanges(cfg)
        # what each rank holds and exchanges (under pp, rank 0's stage has only the dense block)
        mine = ({lay.local_shape()[0] for lay in par.shards.layouts if lay.ep_dim is not None}, exchanged)
        everyone: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        out[name] = {**result, "expert_rows": set().union(*(e[0] for e in everyone)),
                     "exchange_groups": set().union(*(e[1] for e in everyone))}
    return out if torch.distributed.get_rank() == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_meshes_match_one_device(ranks):
    names = [n for n, (r, _, _) in EP_RUNS.items() if r == ranks]
    got = run_ranks(ranks, "tests.test_mixtral:ep_runs", names)[0]
    wants: dict = {}
    for name in names:
        extra, traced = EP_RUNS[name][2], name in EP_TRACED
        if (extra, traced) not in wants:
            wants[extra, traced] = record(Run(_ep_config(None, *extra, traced=traced)), MOE_STEPS)
        want = wants[extra, traced]
        assert_matches_one_device(got[name], want, _ep_config(None, *extra), name)
        assert_router_stats_match(got[name], want, name)
        ep = MeshSpec.parse(EP_RUNS[name][1]["mesh"]).size("ep")
        assert got[name]["expert_rows"] == {4 // ep}, name  # each rank holds its own experts only ...
        assert got[name]["exchange_groups"] == {"ep"}, name  # ... reached by all-to-all over ep


def test_router_statistics_equal_a_reference_from_the_routing():
    # the statistics a compiled step reports (capacity 1.0, so pairs are dropped) against
    # ones computed here from each MoE layer's input, routed again with fxmega.ops.routing
    # and put through the capacity buffers (experts.with_capacity counts what it drops)
    cfg = _moe_config("model.moe.capacity_factor=1.0", "train.micro_batch_size=4")  # 2 micro batches
    got = Run(cfg).do_step()
    seen = []
    original = moe.moe_ffn

    def recording(p, h, settings, valid=None):
        seen.append((tree.map_leaves(lambda t: t.detach().clone(), p), h.detach(), valid))  # before the update
        return original(p, h, settings, valid)

    with unittest.mock.patch.object(moe, "moe_ffn", recording):
        Run(override(cfg, ["train.compile=false"])).do_step()
    settings = cfg.model.moe
    want = dict.fromkeys(("balancing", "z", "dropped", "pairs", "max", "min", "sequences"), 0.0)
    for p, h, valid in seen:
        b, s, d = h.shape
        r = routing.route(h.reshape(-1, d), p["router"], settings)
        want["balancing"] += float(routing.balancing_loss(r, b, settings, valid).sum())
        want["z"] += float(routing.z_loss(r, b, valid).sum())
        rows = experts.capacity(s, settings.top_k, settings.n_experts, settings.capacity_factor)
        out = experts.with_capacity(h, r.experts.view(b, s, -1), r.weights.view(b, s, -1), p["w_gate"], p["w_up"],
                                    p["w_down"], rows)
        want["dropped"] += float(out.dropped)
        want["pairs"] += r.experts.numel()
        load = torch.bincount(r.experts.reshape(-1), minlength=settings.n_experts).float()
        want["max"] += float(load.max() / load.mean())
        want["min"] += float(load.min() / load.mean())
        want["sequences"] += b
    n = len(seen)
    assert n == 2 * cfg.model.n_layers  # every layer has experts; each micro batch measured apart
    assert want["dropped"] > 0  # capacity 1.0 drops some pairs: the fraction is tested, not only 0
    # fp32 values summed over a handful of layers and sequences: 1e-5 relative is far above it
    assert got["moe_balancing_loss"] == pytest.approx(want["balancing"] / want["sequences"], rel=1e-5)
    assert got["moe_z_loss"] == pytest.approx(want["z"] / want["sequences"], rel=1e-5)
    assert got["moe_dropped_fraction"] == pytest.approx(want["dropped"] / want["pairs"], rel=1e-6)
    assert got["moe_load_max"] == pytest.approx(want["max"] / n, rel=1e-6)
    assert got["moe_load_min"] == pytest.approx(want["min"] / n, rel=1e-6)


def test_plan_traces_an_expert_parallel_rank():
    # run.py plan --rank R on dp=4,ep=2 (fake 4-rank group, meta tensors): the sharding table,
    # the memory and communication estimates, and the rank's traced collectives: per MoE
    # layer and micro batch 2 all-to-alls forward and 2 backward, each of the whole capacity
    # buffers [E, sequences x rows, d] (dropless over ep: rows = the sequence length);
    # expert gradients summed over the expert-data ranks (dp), the rest over dp x ep
    cfg = _moe_config("parallel.mesh=dp=4,ep=2", "train.micro_batch_size=2")
    text = plan_report(cfg, rank=1)
    m, t = cfg.model, cfg.train
    assert "memory per rank" in text
    # the collectives table: axis op | count | bytes | nothing before wait | GFLOP before waits |
    # transfer ms | exposed ms traced | exposed ms overlapped
    rows = dict(re.findall(r"^  (\S+ +\S+) +\d+ +(\S+ \S+) +\d+ +\S+ +\S+ +\S+ +\S+ *$", text, re.M))
    a2a_bytes = 4 * m.n_layers * m.moe.n_experts * t.micro_batch_size * t.seq_len * m.d_model * 4
    assert rows["ep     all_to_all_single"] == format_bytes(a2a_bytes)
    assert re.search(rf"^  ep +all_to_all_single +{4 * m.n_layers} ", text, re.M)
    # the estimate counts the same exchanges, each rank sending (ep - 1) / ep of its buffers
    sent = re.escape(format_bytes(a2a_bytes / 2))
    assert re.search(rf"^  ep +{sent} +{4 * m.n_layers} +all_to_all x{4 * m.n_layers}", text, re.M)
    assert re.search(r"^  dp +\S+ \S+ +1 +all_reduce x1", text, re.M)
    assert re.search(r"^  dp\+ep +\S+ \S+ +3 +all_reduce x3", text, re.M)
    experts = 3 * m.n_layers * (m.moe.n_experts // 2) * m.d_model * m.d_ff * 4  # this rank's half, fp32
    assert rows["dp     all_reduce"] == format_bytes(experts)
