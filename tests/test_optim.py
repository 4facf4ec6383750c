"""The functional AdamW and clipping equal torch.optim.AdamW and clip_grad_norm_; a second
optimizer, declared in this file through the optimizer interface, trains, checkpoints and
resumes through the same Run, and the plan counts its state."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from fxmega.config import load, override
from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.models import gpt, model_for
from fxmega.optim import optimizer
from fxmega.optim.adamw import AdamWHyper, adamw_init, adamw_update
from fxmega.optim.optimizer import StateSpec, optimizer_for
from fxmega.parallel.strategy import run_plan
from fxmega.training.optim import clip_by_global_norm_, decay_mask
from fxmega.training.run import Run
from tests.conftest import ROOT
from tests.tolerance import EPS32


@dataclass(frozen=True)
class Momentum:
    """SGD with heavy-ball momentum (torch.optim.SGD's, dampening 0): one fp32 buffer."""

    beta: float = 0.9
    name: str = "momentum"
    whole_matrices: bool = False
    state: tuple[StateSpec, ...] = (StateSpec("momentum"),)

    def update(self, params, grads, state, lr, roles, apply) -> None:
        state["step"].add_(apply)
        buffers = state["momentum"]
        # skipped (apply 0): the buffer and the parameter stay as they were
        torch._foreach_mul_(buffers, 1 - (1 - self.beta) * apply)
        torch._foreach_add_(buffers, torch._foreach_mul(grads, apply))
        torch._foreach_sub_(params, torch._foreach_mul(buffers, lr * apply))


@pytest.fixture
def momentum():
    optimizer.register("momentum", lambda cfg: Momentum())
    yield
    optimizer.unregister("momentum")


def test_adamw_equals_torch_optim_with_decay_mask():
    torch.manual_seed(0)
    shapes = [(8, 4), (4,), (3, 5)]
    decay = [True, False, True]
    ours = [torch.randn(s) for s in shapes]
    ref = [p.clone().requires_grad_() for p in ours]
    hp = AdamWHyper(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW([{"params": [r for r, d in zip(ref, decay) if d], "weight_decay": 0.1},
                             {"params": [r for r, d in zip(ref, decay) if not d], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    state = adamw_init(ours)
    for step in range(5):
        grads = [torch.randn(s) for s in shapes]
        lr = 1e-2 * (step + 1) / 5
        for group in opt.param_groups:
            group["lr"] = lr
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        ours, state = adamw_update(ours, grads, state, torch.tensor(lr), hp, decay)
    for o, r in zip(ours, ref):
        # elementwise only (no reductions): each of 5 steps rounds ~8 operations (moments,
        # bias corrections, sqrt, division, decay) that torch orders differently: 40 eps
        torch.testing.assert_close(o, r.detach(), rtol=40 * EPS32, atol=40 * EPS32 * float(r.abs().max()))
    assert state["step"].item() == 5


def test_clip_equals_clip_grad_norm():
    torch.manual_seed(0)
    grads = [torch.randn(10, 10) * 3, torch.randn(7)]
    ref = [g.clone().requires_grad_() for g in grads]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    norm = clip_by_global_norm_(grads, 1.0)
    torch.testing.assert_close(norm, ref_norm)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r.grad)
    small = [torch.full((3,), 0.01)]
    clip_by_global_norm_(small, 1.0)
    assert torch.equal(small[0], torch.full((3,), 0.01))  # below the limit: untouched


def test_default_decay_mask_skips_norms_biases_embeddings(tiny_gpt):
    from fxmega.core import tree

    specs = gpt.param_specs(tiny_gpt.model)
    mask = dict(zip(tree.paths(specs), decay_mask(specs)))
    assert mask["blocks.0.mlp.w_in"] and mask["blocks.0.attn.wqkv"]
    assert not mask["blocks.0.mlp.b_in"] and not mask["blocks.0.attn_norm.scale"]
    assert not mask["embed.tokens"] and not mask["embed.positions"]
    assert dict(zip(tree.paths(specs), decay_mask(specs, decay_embeddings=True)))["embed.tokens"]


def test_momentum_update_equals_torch_sgd():
    torch.manual_seed(0)
    ours = [torch.randn(4, 3), torch.randn(5)]
    ref = [p.clone().requires_grad_() for p in ours]
    opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    state = {"step": torch.zeros(()), "momentum": [torch.zeros_like(p) for p in ours]}
    for _ in range(4):
        grads = [torch.randn_like(p) for p in ours]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        Momentum().update(ours, grads, state, torch.tensor(0.1), [True, False], torch.ones(()))
    for o, r in zip(ours, ref):
        # elementwise, 4 steps of a multiply-add each, ordered differently: a few eps per step
        torch.testing.assert_close(o, r.detach(), rtol=16 * EPS32, atol=16 * EPS32)


def test_a_second_optimizer_trains_checkpoints_and_resumes_through_run(momentum, tmp_path):
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["optim.optimizer=momentum", "train.compile=false", "train.device=cpu", "data.source=mock",
                    "train.eval_interval=0", "optim.lr=0.05", "optim.warmup_steps=0"])
    run = Run(cfg)
    assert isinstance(run.optimizer, Momentum) and sorted(run.opt_state) == ["momentum", "step"]
    assert [m.shape for m in run.opt_state["momentum"]] == [p.shape for p in tree.leaves(run.params)]
    first = [run.do_step()["loss"] for _ in range(2)]
    run.save(str(tmp_path / "ckpt"))
    after = [run.do_step()["loss"] for _ in range(2)]
    resumed = Run(cfg)
    assert resumed.resume(str(tmp_path / "ckpt")) and resumed.step == 2
    # the momentum buffers came back from the checkpoint: the resumed steps are the same steps
    assert [resumed.do_step()["loss"] for _ in range(2)] == after
    assert first[0] > after[-1]  # it trains
    # the plan counts its state: one fp32 buffer per element against AdamW's two
    mesh = override(cfg, ["parallel.mesh=dp=2", "parallel.zero=1"])
    model = model_for(cfg.model)
    momentum_opt = run_plan(mesh, model).bytes_per_rank()["opt"]
    adamw_opt = run_plan(override(mesh, ["optim.optimizer=adamw"]), model).bytes_per_rank()["opt"]
    assert adamw_opt == 2 * momentum_opt > 0


def test_an_unknown_optimizer_is_refused_naming_the_known_ones():
    cfg = load(ROOT / "configs" / "tiny_gpt.py")
    with pytest.raises(ConfigError, match="optim.optimizer='sgd': use one of adamw"):
        optimizer_for(dataclasses.replace(cfg.optim, optimizer="sgd"))
