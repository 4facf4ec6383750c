"""Model families register by name: a family defined in this file — an attention-free
language model, each block a token-mixing MLP over the sequence (a causal MLP-Mixer) then
a channel MLP — trains through the same Run as the built-in ones, on one device and on
pp=2 and tp=2 meshes, without any fxmega file naming it."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import pytest
import torch

from fxmega.config import DataConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig, to_dict
from fxmega.core.errors import ConfigError
from fxmega.core.spec import ONES, ZEROS, ParamSpec, normal
from fxmega.models import family_name, model_for, registry
from fxmega.models.family import ModelFamily
from fxmega.ops import layers, objectives
from fxmega.parallel import distributed
from fxmega.sharding.layout import shard
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.tolerance import assert_runs_match


@dataclass(frozen=True)
class Config:
    vocab_size: int = 64
    max_seq_len: int = 16
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 1  # no attention; the protocol's field (FLOP counts read it)
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model

    def validate(self, prefix: str = "model") -> None:
        if min(self.vocab_size, self.max_seq_len, self.d_model, self.n_layers) <= 0:
            raise ConfigError(f"{prefix}: every size must be positive")


def param_specs(cfg: Config) -> dict:
    d, s = cfg.d_model, cfg.max_seq_len
    w = normal(0.02)

    def norm() -> dict:
        return {"scale": ParamSpec((d,), ("embed",), ONES), "bias": ParamSpec((d,), ("embed",), ZEROS)}

    block = {"token_norm": norm(), "token_mix": ParamSpec((s, s), (None, None), w),
             "channel_norm": norm(), "w_in": ParamSpec((d, 2 * d), ("embed", "mlp"), w),
             "w_out": ParamSpec((2 * d, d), ("mlp", "embed"), w)}
    return {"embed": {"tokens": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), w)},
            "blocks": [block for _ in range(cfg.n_layers)], "final_norm": norm()}


EMBED_PARAMS = ("embed",)
HEAD_PARAMS = ("final_norm", "embed")
EMBED_INPUTS: tuple[str, ...] = ()


def objective(cfg: Config) -> objectives.Objective:
    return objectives.causal_lm(cfg.vocab_size)


def embed(params: dict, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    return shard(torch.nn.functional.embedding(tokens, params["embed"]["tokens"]), "batch", "seq", "embed")


def block(p: dict, x: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None) -> torch.Tensor:
    n = x.shape[1]
    h = shard(layers.layer_norm(x, **p["token_norm"], eps=cfg.norm_eps), "batch", None, "embed")
    mix = torch.tril(p["token_mix"][:n, :n])  # position i mixes positions <= i only
    x = x + shard(torch.einsum("ij,bjd->bid", mix, h), "batch", "seq", "embed")
    h = shard(layers.layer_norm(x, **p["channel_norm"], eps=cfg.norm_eps), "batch", None, "embed")
    h = shard(torch.nn.functional.gelu(layers.linear(h, p["w_in"])), "batch", None, "mlp")
    return x + shard(layers.linear(h, p["w_out"]), "batch", "seq", "embed")


def head(params: dict, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    h = shard(layers.layer_norm(x, **params["final_norm"], eps=cfg.norm_eps), "batch", None, "embed")
    return shard(layers.linear(h, params["embed"]["tokens"].t()), "batch", None, "vocab")


def forward(params: dict, tokens: torch.Tensor, cfg: Config, attention_mask: torch.Tensor | None = None):
    x = embed(params, tokens, cfg)
    for p in params["blocks"]:
        x = block(p, x, cfg)
    return head(params, x, cfg)


MIXER = ModelFamily(name="causal-mixer", Config=Config, param_specs=param_specs, embed=embed, block=block, head=head,
                    objective=objective, EMBED_PARAMS=EMBED_PARAMS, HEAD_PARAMS=HEAD_PARAMS)
registry.register(MIXER)  # the ranks import this module, and so register it too


def mixer_config(parallel: dict | None = None) -> RunConfig:
    cfg = RunConfig(model=Config(), name="mixer",
                    train=TrainConfig(steps=30, micro_batch_size=4, global_batch_size=8, seq_len=16, compile=False,
                                      device="cpu", eval_interval=0, eval_iters=1, log_interval=10),
                    optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2),
                    data=DataConfig(source="mock"))
    return cfg if parallel is None else dataclasses.replace(cfg, parallel=ParallelConfig(**parallel))


def test_a_family_registered_from_a_test_file_trains():
    cfg = mixer_config()
    assert model_for(cfg.model) is MIXER and family_name(cfg.model) == "causal-mixer"
    assert to_dict(cfg)["model"]["family"] == "causal-mixer"
    run = Run(cfg)
    losses = [run.do_step()["loss"] for _ in range(30)]
    assert losses[0] > 4.0  # ~ln(61): the mock tokens are uniform over 61 ids
    assert sum(losses[-5:]) / 5 < losses[0] - 0.2, losses  # it learns (the mock stream repeats a pattern)


def test_registering_badly_is_a_clear_error():
    with pytest.raises(ConfigError, match="register a ModelFamily .*, not module: end the family's module with "
                                          "FAMILY = ModelFamily"):
        registry.register(sys.modules[__name__])  # a module with the pieces is not yet a family
    with pytest.raises(TypeError, match="missing 3 required .*'objective', 'EMBED_PARAMS', and 'HEAD_PARAMS'"):
        ModelFamily(name="broken", Config=int, param_specs=param_specs, embed=embed, block=block, head=head)
    other_config = type("OtherConfig", (Config,), {})
    with pytest.raises(ConfigError, match="'causal-mixer' is already registered"):
        registry.register(dataclasses.replace(MIXER, Config=other_config))
    with pytest.raises(ConfigError, match="Config is already the Config of model family 'causal-mixer'"):
        registry.register(dataclasses.replace(MIXER, name="mixer-again"))
    with pytest.raises(ConfigError, match="model family name 'no spaces'"):
        registry.register(dataclasses.replace(MIXER, name="no spaces"))
    with pytest.raises(ConfigError, match="not the Config of a registered model family"):
        model_for(object())
    with pytest.raises(ConfigError, match="model family 'nope' is not registered; known: bert, causal-mixer"):
        registry.get("nope")


def meshes(names: list[str], steps: int) -> dict | None:
    """On each mesh: the mixer's per-step metrics (rank 0)."""
    out = {}
    for name in names:
        cfg = mixer_config(MESHES[name])
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        out[name] = [run.do_step() for _ in range(steps)]
    return out if torch.distributed.get_rank() == 0 else None


MESHES = {"pp2": dict(mesh="pp=2"), "tp2": dict(mesh="tp=2"), "dp2_zero3": dict(mesh="dp=2", rules="zero3")}


@pytest.mark.slow
def test_a_registered_family_on_pp_tp_and_zero3_matches_one_device():
    run = Run(mixer_config())
    ref = [run.do_step() for _ in range(4)]
    got = run_ranks(2, "tests.test_registry:meshes", list(MESHES), 4)[0]
    for name in MESHES:
        assert_runs_match(got[name], ref, run.cfg, name)
