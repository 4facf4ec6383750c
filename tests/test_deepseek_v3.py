"""DeepSeek-V3 (fxmega/models/deepseek_v3.py) in training: the tiny model trains, its
auxiliary-loss-free selection bias moves with the load, and the meshes it runs on (dp,
ZeRO-3, fsdp, ep, tp with and without sequence parallelism) equal one device in losses,
gradient norms, gradients and router statistics; the 671B config's sizes and its latent
cache. Its float64 logits against transformers'
DeepseekV3 both ways: tests/test_convert.py; generation over the latent cache equal to the
uncached forward: tests/test_generate.py."""

from __future__ import annotations

import pytest
import torch

from fxmega.config import load
from fxmega.core.errors import ConfigError
from fxmega.models import deepseek_v3, llama, model_for
from fxmega.models.pieces import init_cache
from fxmega.planning.summary import summary
from fxmega.training.checks import preflight
from fxmega.training.run import Run
from tests.conftest import ROOT
from tests.multirank import run_ranks
from tests.parity import assert_matches_one_device, record
from tests.sharding_workers import tiny_config, train
from tests.test_mixtral import assert_router_stats_match

STEPS = 3
# ep=2 folded over dp=2: each of the 2 ranks holds half the experts; the tokens reach them by all-to-all
MESHES = {"dp2": dict(mesh="dp=2"), "zero3": dict(mesh="dp=2", rules="zero3"),
          "fsdp2": dict(mesh="fsdp=2", rules="fsdp"), "ep2": dict(mesh="dp=2,ep=2"),
          # heads split over tp (the up-projections and wo), the latents replicated; with sequence parallelism
          "tp2": dict(mesh="tp=2"), "tp2_sp": dict(mesh="tp=2", sequence_parallel=True)}


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
    assert sorted(biases) == [f"blocks.{i}.moe.expert_bias" for i in (1, 2)]  # block 0 is dense
    for path, bias in biases.items():
        assert bias.abs().max() > 0 and bias.abs().max() <= STEPS * rate * (1 + 1e-6), path
    assert one_device["losses"][-1] < one_device["losses"][0]


# make test runs the riskiest three (gathers, all-to-alls, split heads with the sequence split);
# make e2e the rest too
RISKIEST = ("zero3", "ep2", "tp2_sp")


@pytest.mark.slow
@pytest.mark.parametrize("names", [pytest.param(RISKIEST, id="riskiest"),
                                   pytest.param(tuple(m for m in MESHES if m not in RISKIEST), id="others",
                                                marks=pytest.mark.e2e)])
def test_meshes_equal_one_device(one_device, names):
    got = run_ranks(2, "tests.test_deepseek_v3:mesh_runs", list(names))[0]
    for name in names:
        assert_matches_one_device(got[name], one_device, _config(), name)
        assert_router_stats_match(got[name], one_device, name)


@pytest.mark.parametrize("mesh", ["pp=2", "cp=2"])
def test_meshes_not_built_for_it_yet_are_refused(mesh):
    cfg = tiny_config({"mesh": mesh}, model="tiny_deepseek_v3")
    with pytest.raises(ConfigError, match="deepseek_v3 family has been shown equal to one device on dp, fsdp, ep, tp"):
        preflight(cfg, model_for(cfg.model), torch.device("cpu"))


def test_the_671b_config_has_the_published_sizes_and_its_latent_cache():
    """DeepSeek-V3's report: 671B parameters, 37B activated per token. Its cache holds the
    512-wide latent and the 64-wide rotary key per block: 70,272 bytes a token in bf16, where
    the same 128 heads with grouped keys and values in 8 groups (192 + 128 wide) would hold
    4.4x as much, and with full heads 71x."""
    cfg = load(ROOT / "configs" / "deepseek_v3_671b.py").model
    text = summary(cfg, 4096)
    assert "parameters: 671,026,419,200" in text and "active per token: 37,552,297,472" in text
    assert "KV cache per token: 70,272 bytes in bf16 (61 blocks x 512 + 64 values)" in text
    gqa = cfg.n_layers * 8 * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    assert round(gqa / 70_272, 1) == 4.4 and round(gqa * 16 / 70_272) == 71


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
