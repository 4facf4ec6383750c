"""DeepSeek-V3 (fxmega/models/deepseek_v3.py) in training: the tiny model trains, its
auxiliary-loss-free selection bias moves with the load, and the data-parallel meshes it
runs on equal one device in losses, gradient norms, gradients and router statistics. Its
float64 logits against transformers' DeepseekV3 both ways: tests/test_convert.py."""

from __future__ import annotations

import pytest
import torch

from fxmega.core.errors import ConfigError
from fxmega.models import model_for
from fxmega.training.checks import preflight
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.parity import assert_matches_one_device, record
from tests.sharding_workers import tiny_config, train
from tests.test_mixtral import assert_router_stats_match

STEPS = 3
MESHES = {"dp2": dict(mesh="dp=2"), "zero3": dict(mesh="dp=2", rules="zero3"), "fsdp2": dict(mesh="fsdp=2",
                                                                                            rules="fsdp")}


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


@pytest.mark.slow
def test_data_parallel_meshes_equal_one_device(one_device):
    got = run_ranks(2, "tests.test_deepseek_v3:mesh_runs", list(MESHES))[0]
    for name in MESHES:
        assert_matches_one_device(got[name], one_device, _config(), name)
        assert_router_stats_match(got[name], one_device, name)


@pytest.mark.parametrize("mesh", ["tp=2", "pp=2", "cp=2", "dp=2,ep=2"])
def test_meshes_not_built_for_it_yet_are_refused(mesh):
    cfg = tiny_config({"mesh": mesh}, model="tiny_deepseek_v3")
    with pytest.raises(ConfigError, match="deepseek_v3 family has been shown equal to one device on the data axes"):
        preflight(cfg, model_for(cfg.model), torch.device("cpu"))
