"""DeepSeek-V3 (fxmega/models/deepseek_v3.py) in training: the tiny model trains, its
auxiliary-loss-free selection bias moves with the load, and the meshes it runs on (dp,
ZeRO-3, fsdp, ep, tp with and without sequence parallelism, pp, cp) equal one device in losses,
gradient norms, gradients, router statistics and multi-token prediction's depth losses;
multi-token prediction's loss and gradients equal a float64 reference of the report's
equations; the 671B config's sizes and its latent cache. Its float64 logits against transformers'
DeepseekV3 both ways: tests/test_convert.py; generation over the latent cache equal to the
uncached forward: tests/test_generate.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fxmega.cli import main
from fxmega.config import load, override
from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.models import deepseek_v3, llama, lm_loss_sum, model_for
from fxmega.models.pieces import init_cache
from fxmega.ops import aux_loss, layers, mtp
from fxmega.ops.init import init_params
from fxmega.planning.summary import summary
from fxmega.training.checks import preflight
from fxmega.training.run import Run
from tests.conftest import ROOT
from tests.multirank import run_ranks
from tests.parity import assert_losses_match, assert_matches_one_device, record
from tests.sharding_workers import tiny_config, train
from tests.test_mixtral import assert_router_stats_match

STEPS = 3
# ep=2 folded over dp=2: each of the 2 ranks holds half the experts; the tokens reach them by all-to-all
MESHES = {"dp2": dict(mesh="dp=2"), "zero3": dict(mesh="dp=2", rules="zero3"),
          "fsdp2": dict(mesh="fsdp=2", rules="fsdp"), "ep2": dict(mesh="dp=2,ep=2"),
          # heads split over tp (the up-projections and wo), the latents replicated; with sequence parallelism
          "tp2": dict(mesh="tp=2"), "tp2_sp": dict(mesh="tp=2", sequence_parallel=True),
          # the first block (dense) and the second on stage 0; the third, the head and MTP on stage 1
          "pp2": dict(mesh="pp=2")}


def _config(parallel: dict | None = None):
    return tiny_config(parallel, model="tiny_deepseek_v3", extra=("train.compile_backend=aot_eager",))


def mesh_runs(names: list[str]) -> dict | None:
    out = {name: train(_config(MESHES[name]), STEPS, collectives=False)[1] for name in names}
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope="module")
def one_device() -> dict:
    return record(Run(_config()), STEPS)


def test_the_selection_bias_moves_with_the_load_and_the_loss_falls(one_device):
    """Each MoE block's expert bias starts at zero and is moved by the update (sign of the
    load's distance from the mean, outside AdamW): after 3 steps it is not zero, and it has
    moved by 3 steps of the rate at most."""
    cfg = _config()
    rate = cfg.model.moe.bias_update_rate
    biases = {p: t for p, t in one_device["params"].items() if p.endswith("expert_bias")}
    # block 0 is dense; the MTP module's block has experts, and a bias, too
    assert sorted(biases) == [*(f"blocks.{i}.moe.expert_bias" for i in (1, 2)), "mtp.0.block.moe.expert_bias"]
    for path, bias in biases.items():
        assert bias.abs().max() > 0 and bias.abs().max() <= STEPS * rate * (1 + 1e-6), path
    assert one_device["losses"][-1] < one_device["losses"][0]


# make test runs the riskiest four (gathers, all-to-alls, split heads with the sequence split,
# MTP on the last stage reading the embedding the first stage holds);
# make e2e the rest too
RISKIEST = ("zero3", "ep2", "tp2_sp", "pp2")


@pytest.mark.slow
@pytest.mark.parametrize("names", [pytest.param(RISKIEST, id="riskiest"),
                                   pytest.param(tuple(m for m in MESHES if m not in RISKIEST), id="others",
                                                marks=pytest.mark.e2e)])
def test_meshes_equal_one_device(one_device, names):
    got = run_ranks(2, "tests.test_deepseek_v3:mesh_runs", list(names))[0]
    for name in names:
        assert_matches_one_device(got[name], one_device, _config(), name)
        assert_router_stats_match(got[name], one_device, name)
        # each depth's loss is a cross-entropy mean like the main loss: the same rounding bound
        assert got[name]["mtp"][0] and len(got[name]["mtp"]) == STEPS, name
        for key in one_device["mtp"][0]:
            assert_losses_match([m[key] for m in got[name]["mtp"]], [m[key] for m in one_device["mtp"]], _config(),
                                f"{name} {key}")


# context parallelism, without MTP (refused under cp below): MLA's attention over the chunks by
# all-gather, ring (values narrower than queries and keys) and all-to-all
CP_MESHES = {"cp2": dict(mesh="cp=2"), "cp2_ring": dict(mesh="cp=2", cp_attention="ring"),
             "cp2_a2a": dict(mesh="cp=2", cp_attention="a2a")}


def _cp_config(parallel: dict | None = None):
    return tiny_config(parallel, model="tiny_deepseek_v3", extra=("train.compile_backend=aot_eager",
                                                                  "model.mtp_depth=0"))


def cp_runs(names: list[str]) -> dict | None:
    out = {name: train(_cp_config(CP_MESHES[name]), STEPS, collectives=False)[1] for name in names}
    return out if torch.distributed.get_rank() == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("names", [pytest.param(("cp2_ring",), id="ring"),
                                   pytest.param(("cp2", "cp2_a2a"), id="others", marks=pytest.mark.e2e)])
def test_context_parallel_equals_one_device(names):
    """Losses, gradient norms, gradients and parameters (the selection bias's updates from
    the load summed over cp included); the routers' statistics, per-sequence measures of which
    a cp rank sees a part, are not collected under cp (the run says so)."""
    want = record(Run(_cp_config()), STEPS)
    got = run_ranks(2, "tests.test_deepseek_v3:cp_runs", list(names))[0]
    for name in names:
        assert_matches_one_device(got[name], want, _cp_config(), name)
        assert want["router"][0] and not any(got[name]["router"]), name


def test_cp_refuses_what_reads_a_whole_sequence():
    cfg = tiny_config({"mesh": "cp=2"}, model="tiny_deepseek_v3")
    with pytest.raises(ConfigError, match="multi-token prediction depth k reads the targets k positions on.*"
                                          "model.mtp_depth=0"):
        preflight(cfg, model_for(cfg.model), torch.device("cpu"))
    cfg = override(cfg, ["model.mtp_depth=0", "model.moe.aux_loss_coeff=0.001"])
    with pytest.raises(ConfigError, match="aux_loss_coeff=0.001 weighs a balancing loss per whole sequence"):
        preflight(cfg, model_for(cfg.model), torch.device("cpu"))


def test_the_671b_config_has_the_published_sizes_and_its_latent_cache():
    """DeepSeek-V3's report: 671B parameters, 37B activated per token, and the MTP module
    beside them (the published checkpoint's 685B counts it with its own copies of the
    embedding and head: 671.03B + 11.61B + 2 x 0.93B = 684.49B). Its cache holds the
    512-wide latent and the 64-wide rotary key per block: 70,272 bytes a token in bf16, where
    the same 128 heads with grouped keys and values in 8 groups (192 + 128 wide) would hold
    4.4x as much, and with full heads 71x."""
    cfg = load(ROOT / "configs" / "deepseek_v3_671b.py").model
    text = summary(cfg, 4096)
    assert "parameters: 682,636,487,424" in text and "active per token: 37,552,297,472" in text
    assert "multi-token prediction modules: 11,610,068,224; the main model: 671,026,419,200" in text
    assert "KV cache per token: 70,272 bytes in bf16 (61 blocks x 512 + 64 values)" in text
    gqa = cfg.n_layers * 8 * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    assert round(gqa / 70_272, 1) == 4.4 and round(gqa * 16 / 70_272) == 71


PLAN_671B = ["plan", "--config", str(ROOT / "configs" / "deepseek_v3_671b.py"), "--memory-per-device", "80GB"]


def test_the_671b_plan_on_the_reports_layout(capsys):
    """The report's layout (section 3.2: 16 pipeline stages, 64-way expert parallelism over
    ZeRO-1 data parallelism, 2048 H800s of 80 GB), on paper: with full recompute and an
    expert capacity of 1.25 the plan fits, the first stage (embedding and 4 blocks) the
    fullest; the last holds 1 block, the head and the MTP module. Dropless it does not fit:
    the all-to-all's static buffers give each expert a whole sequence's rows."""
    layout = ["--mesh", "pp=16,dp=128,ep=64", "--zero", "1", "--recompute", "full"]
    assert main([*PLAN_671B, *layout, "--set", "model.moe.capacity_factor=1.25"]) == 0
    out = capsys.readouterr().out
    assert "fits: peak 47.2 GiB on pp rank 0 is 63% of 74.5 GiB per device" in out
    assert "  15       1       10.3 GiB" in out  # one block, the head, the MTP module
    main([*PLAN_671B, *layout])
    assert "OOM: pp rank 0 needs 93.4 GiB" in capsys.readouterr().out


@pytest.mark.e2e
def test_the_largest_deepseek_v3_that_mesh_auto_fits_on_64_h100s(capsys):
    """671B cannot fit 64 x 80 GB (fp32 masters, gradients and AdamW: 16 bytes a parameter,
    10.9 TB against 5.1); kept at DeepSeek-V3's widths, 26 layers (279.9B with the MTP
    module) is the deepest that ``--mesh auto`` places, 27 none."""
    auto = [*PLAN_671B, "--mesh", "auto", "--devices", "64", "--device-profile", "h100",
            "--set", "model.moe.capacity_factor=1.25"]
    main([*auto, "--set", "model.n_layers=26"])
    out = capsys.readouterr().out
    assert "4 fit and divide" in out and "dp=8,tp=8,pp=1,ep=8, zero 3, recompute full" in out
    main([*auto, "--set", "model.n_layers=27"])
    assert "0 fit and divide" in capsys.readouterr().out


def test_the_latent_cache_holds_latents_not_heads():
    """The tensors decoding allocates, measured: a latent and a rotary key per token and block,
    against a Llama of the same width, depth and heads with 2 key-value groups."""
    cfg = load(ROOT / "configs" / "tiny_deepseek_v3.py").model
    cache = init_cache(deepseek_v3.FAMILY, cfg, range(cfg.n_layers), batch=1, max_len=10)
    measured = sum(t.numel() * t.element_size() for kv in cache.values() for t in kv) / 10
    assert measured == cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # fp32 here
    llama_cfg = llama.Config(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                             n_heads=cfg.n_heads, n_kv_heads=2, d_ff=cfg.d_ff)
    gqa = init_cache(llama.FAMILY, llama_cfg, range(cfg.n_layers), batch=1, max_len=10)
    assert measured < sum(t.numel() * t.element_size() for kv in gqa.values() for t in kv) / 10


# ---- multi-token prediction against the report's equations -----------------------------------

def _reference(params: dict, tokens: torch.Tensor, mask: torch.Tensor, cfg: deepseek_v3.Config):
    """The DeepSeek-V3 report's section 2.2, written over truncated sequences as the report
    indexes them (not fxmega's shifted full-length ones): depth ``k`` covers the positions
    ``i < T - k``, combines ``h^{k-1}_i`` with ``Emb(t_{i+k})`` and predicts ``t_{i+k+1}``.
    Returns the training loss (main mean plus weight/D times each depth's summed loss, over
    the main loss's targets) and each depth's (summed loss, targets)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    h = deepseek_v3.embed(params, inputs, cfg)
    for p in params["blocks"]:
        h = deepseek_v3.block(p, h, cfg)
    logits = llama.head(params, h, cfg)
    total = (F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none") * mask.flatten()).sum()
    depths = []
    for k, p in enumerate(params["mtp"], start=1):
        n = seq - k
        emb = layers.rms_norm(deepseek_v3.embed(params, targets[:, k - 1:k - 1 + n], cfg), p["enorm"]["scale"],
                              cfg.norm_eps)  # Emb(t_{i+k}), t_{i+k} = targets[i+k-1]
        h = torch.cat([emb, layers.rms_norm(h[:, :n], p["hnorm"]["scale"], cfg.norm_eps)], dim=-1) @ p["eh_proj"]
        h = deepseek_v3.block(p["block"], h, cfg)
        logits = layers.rms_norm(h, p["norm"]["scale"], cfg.norm_eps) @ params["head"]
        ce = F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten(), reduction="none") * mask[:, k:].flatten()
        depths.append((ce.sum(), mask[:, k:].sum()))
        total = total + cfg.mtp_loss_weight / cfg.mtp_depth * ce.sum()
    return total / mask.sum(), depths


def test_mtp_loss_and_gradients_equal_the_float64_reference():
    """Two MTP depths on the tiny model in float64, with a loss mask that leaves targets out:
    the gradient of every parameter that a loss trains (the selection bias is moved by the
    load, not a loss) equals the reference's, and each depth's summed loss and target count
    that reach the step's meter equal the reference's."""
    cfg = load(ROOT / "configs" / "tiny_deepseek_v3.py").model
    cfg = dataclasses.replace(cfg, mtp_depth=2, mtp_loss_weight=0.3)
    params = tree.map_leaves(lambda t: t.double().requires_grad_(), init_params(deepseek_v3.param_specs(cfg), seed=3))
    tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.float64)
    mask[0, 3] = mask[1, 7:] = 0  # a target left out, and a row's tail (where depth 1 and 2 targets come from)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
    names = deepseek_v3.FAMILY.meter_stats(cfg)
    meter = torch.zeros(len(names), dtype=torch.float64, requires_grad=True)
    inv_tokens = 1.0 / mask.sum()
    with aux_loss.gradient_scale(inv_tokens), aux_loss.metering(meter, names):
        loss = lm_loss_sum(params, batch, cfg) * inv_tokens
    paths = [p for p in tree.paths(params) if not p.endswith("expert_bias")]
    leaves = dict(tree.items(params))
    got = torch.autograd.grad(loss, [leaves[p] for p in paths] + [meter])
    want_loss, depths = _reference(params, tokens, mask, cfg)
    want = torch.autograd.grad(want_loss, [leaves[p] for p in paths])
    # float64 except the cross-entropy, which fxmega runs in fp32 by design
    # (layers.cross_entropy_sum): its softmax over 256 classes rounds at ~256 x 6e-8 = 1.5e-5
    # of the largest gradient entry; a misplaced target or weight differs by O(1) of it
    for path, g, w in zip(paths, got, want):
        diff, scale = float((g - w).abs().max()), float(w.abs().max())
        assert diff <= 1.5e-5 * scale, (path, diff, scale)
    assert any(float(g.abs().max()) > 0 for path, g in zip(paths, got) if path.startswith("mtp.1."))
    stats = dict(zip(names, got[-1].tolist()))
    for k, (loss_sum, n) in enumerate(depths, start=1):
        assert stats[f"mtp{k}_loss_sum"] == pytest.approx(float(loss_sum.detach()), rel=1.5e-5)  # fp32 cross-entropy
        assert stats[f"mtp{k}_targets"] == float(n)
    assert mtp.report(stats)["mtp_loss_2"] == pytest.approx(float(depths[1][0].detach() / depths[1][1]), rel=1.5e-5)


def test_mtp_is_refused_with_the_chunked_loss_and_negative_sizes():
    cfg = override(load(ROOT / "configs" / "tiny_deepseek_v3.py"), ["compute.loss_chunk=16"])
    with pytest.raises(ConfigError, match="head also runs embed, mtp .multi-token prediction.*model.mtp_depth=0"):
        preflight(cfg, model_for(cfg.model), torch.device("cpu"))
    with pytest.raises(ConfigError, match="mtp_depth=-1"):
        dataclasses.replace(cfg.model, mtp_depth=-1).validate()
