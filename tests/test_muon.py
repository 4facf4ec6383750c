"""Muon on one device: which parameters it takes and how each is seen as matrices, its update
against a float64 reference of the equations, AdamW unchanged on the rest, a skipped step
that changes nothing, and ``Run`` training, checkpointing and resuming with it."""

from __future__ import annotations

import math

import pytest
import torch

from fxmega.config import load, override
from fxmega.core import tree
from fxmega.models import model_for
from fxmega.optim.adamw import AdamWHyper, adamw_update
from fxmega.optim.muon import NS_COEFFICIENTS, Muon, MuonHyper, newton_schulz
from fxmega.optim.optimizer import ParamRole
from fxmega.parallel.strategy import run_plan
from fxmega.planning.report import estimate_plan, traffic_table
from fxmega.training.checks import preflight
from fxmega.training.optim import param_roles
from fxmega.training.run import Run
from tests.conftest import ROOT
from tests.tiers import inductor_in_e2e
from tests.tolerance import EPS32

HYPER = MuonHyper(momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1)
ADAMW = AdamWHyper(0.9, 0.95, 1e-8, 0.1)


def _roles(config: str) -> dict[str, ParamRole]:
    cfg = load(ROOT / "configs" / f"{config}.py")
    specs = model_for(cfg.model).param_specs(cfg.model)
    return dict(zip(tree.paths(specs), param_roles(specs)))


def test_muon_takes_the_hidden_matrices_and_adamw_the_tables_norms_and_biases():
    gpt = _roles("tiny_gpt")
    muon = {p for p, r in gpt.items() if r.matrix is not None}
    assert {p.split(".", 2)[-1] for p in muon} == {"attn.wqkv", "attn.wo", "mlp.w_in", "mlp.w_out"}
    assert gpt["embed.tokens"].matrix is None and gpt["embed.positions"].matrix is None
    assert gpt["blocks.0.attn.bqkv"].matrix is None and gpt["blocks.0.attn_norm.scale"].matrix is None
    # the fused QKV is three matrices (one per projection), embed x (heads x head_dim) each
    qkv = gpt["blocks.0.attn.wqkv"].matrix
    assert qkv.shape((64, 3, 4, 16)) == (3, 64, 64)
    assert gpt["blocks.0.attn.wo"].matrix.shape((4, 16, 64)) == (1, 64, 64)
    assert _roles("tiny_llama")["head"].matrix is None  # the untied output head has a vocab axis
    moe = _roles("tiny_moe")
    assert moe["blocks.0.moe.w_gate"].matrix.shape((4, 64, 64)) == (4, 64, 64)  # one per expert
    assert moe["blocks.0.moe.router"].matrix is not None
    assert _roles("tiny_t5")["relative.encoder"].matrix is None  # a table looked up by bucket
    bert = _roles("tiny_bert")
    assert bert["embed.token_types"].matrix is None and bert["mlm.w"].matrix is not None


def test_a_matrix_view_is_undone_exactly():
    view = _roles("tiny_gpt")["blocks.0.attn.wqkv"].matrix
    w = torch.randn(64, 3, 4, 16)
    m = view.to_matrices(w)
    torch.testing.assert_close(m[1], w[:, 1].reshape(64, 64), rtol=0, atol=0)  # K's matrix
    torch.testing.assert_close(view.from_matrices(m, tuple(w.shape)), w, rtol=0, atol=0)


def _ns_reference(u: torch.Tensor, steps: int) -> torch.Tensor:
    """The iteration on one float64 matrix, written out as the equations say."""
    a, b, c = NS_COEFFICIENTS
    x = u.double()
    x = x.T if x.shape[0] > x.shape[1] else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if u.shape[0] > u.shape[1] else x


def _ns_bound(rows: int, cols: int, steps: int) -> float:
    # each step's products sum over max(A,B) (the Gram) and twice over min(A,B), on entries of at
    # most 1 (the spectral norm stays near 1); an earlier step's error grows by at most the
    # polynomial's largest slope on [0, 1.2], its slope at 0 (a), so the errors add up geometrically
    a = NS_COEFFICIENTS[0]
    return (a ** steps - 1) / (a - 1) * (max(rows, cols) + 2 * min(rows, cols)) * EPS32


def test_newton_schulz_in_fp32_equals_float64_and_orthogonalises():
    torch.manual_seed(0)
    for rows, cols in [(64, 256), (256, 64), (64, 64)]:
        u = torch.randn(2, rows, cols)
        got = newton_schulz(u, 5, torch.float32)
        for k in range(2):
            ref = _ns_reference(u[k], 5)
            assert (got[k].double() - ref).abs().max() <= _ns_bound(rows, cols, 5)
            # every singular value is pushed into the quintic's band around 1 (Keller: ~0.7 to 1.2)
            s = torch.linalg.svdvals(ref)
            assert s.max() < 1.25 and (s.min() > 0.6 or rows == cols)


def _muon_reference(params, grads_per_step, roles, lr):
    """Muon on the matrices and AdamW on the rest, in float64, each parameter on its own."""
    params = [p.double().clone() for p in params]
    buf = [torch.zeros_like(p) for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grads_per_step, start=1):
        for k, (p, g, role) in enumerate(zip(params, grads, roles)):
            g = g.double()
            if role.matrix is None:  # torch.optim.AdamW
                p.mul_(1 - lr * ADAMW.weight_decay if role.decay else 1.0)
                m[k] = ADAMW.beta1 * m[k] + (1 - ADAMW.beta1) * g
                v[k] = ADAMW.beta2 * v[k] + (1 - ADAMW.beta2) * g * g
                denom = (v[k] / (1 - ADAMW.beta2 ** step)).sqrt() + ADAMW.eps
                p.sub_(lr / (1 - ADAMW.beta1 ** step) * m[k] / denom)
                continue
            buf[k] = HYPER.momentum * buf[k] + (1 - HYPER.momentum) * g
            u = (1 - HYPER.momentum) * g + HYPER.momentum * buf[k]
            stack = role.matrix.to_matrices(u)
            rows, cols = stack.shape[1:]
            ortho = torch.stack([_ns_reference(x, HYPER.ns_steps) for x in stack])
            update = role.matrix.from_matrices(ortho, tuple(p.shape)) * 0.2 * math.sqrt(max(rows, cols))
            p.mul_(1 - lr * HYPER.weight_decay if role.decay else 1.0)
            p.sub_(lr * update)
    return params


def test_muon_update_equals_a_float64_reference_and_adamw_is_unchanged_on_the_rest():
    torch.manual_seed(0)
    roles = _roles("tiny_moe")
    cfg = load(ROOT / "configs" / "tiny_moe.py")
    specs = tree.leaves(model_for(cfg.model).param_specs(cfg.model))
    params = [0.05 * torch.randn(s.shape) for s in specs]
    role_list = list(roles.values())
    steps = [[torch.randn_like(p) for p in params] for _ in range(3)]
    lr = 0.02
    ours = [p.clone() for p in params]
    state = {"step": torch.zeros(()), "exp_avg": [torch.zeros_like(p) for p in params],
             "exp_avg_sq": [torch.zeros_like(p) for p in params]}
    optimizer = Muon(HYPER, ADAMW)
    for grads in steps:
        optimizer.update(ours, [g.clone() for g in grads], state, torch.tensor(lr), role_list, torch.ones(()))
    ref = _muon_reference(params, steps, role_list, lr)
    for p, r, role, spec in zip(ours, ref, role_list, specs):
        if role.matrix is None:
            # elementwise AdamW, 3 steps of a few operations each: a few eps of the parameter's size
            torch.testing.assert_close(p.double(), r, rtol=0, atol=32 * EPS32)
            continue
        n, rows, cols = role.matrix.shape(spec.shape)
        # each step moves it by lr x the scale x an orthogonalised matrix, within the NS bound
        bound = 3 * lr * 0.2 * math.sqrt(max(rows, cols)) * _ns_bound(rows, cols, 5) + 32 * EPS32
        assert (p.double() - r).abs().max() <= bound, spec.axes
    # AdamW's part is the plain AdamW update of those parameters, to the bit
    others = [k for k, role in enumerate(role_list) if role.matrix is None]
    alone = [params[k].clone() for k in others]
    adam_state = {"step": torch.zeros(()), "exp_avg": [torch.zeros_like(p) for p in alone],
                  "exp_avg_sq": [torch.zeros_like(p) for p in alone]}
    for grads in steps:
        adamw_update(alone, [grads[k].clone() for k in others], adam_state, torch.tensor(lr), ADAMW,
                     [role_list[k].decay for k in others], torch.ones(()))
    for k, a in zip(others, alone):
        torch.testing.assert_close(ours[k], a, rtol=0, atol=0)
    assert state["step"].item() == 3


def test_a_skipped_step_changes_nothing_even_with_nan_gradients():
    roles = list(_roles("tiny_gpt").values())
    cfg = load(ROOT / "configs" / "tiny_gpt.py")
    params = [torch.randn(s.shape) for s in tree.leaves(model_for(cfg.model).param_specs(cfg.model))]
    state = {"step": torch.zeros(()), "exp_avg": [torch.randn_like(p) for p in params],
             "exp_avg_sq": [torch.rand_like(p) for p in params]}
    before = [p.clone() for p in params], [b.clone() for b in state["exp_avg"]]
    grads = [torch.full_like(p, float("nan")) for p in params]
    Muon(HYPER, ADAMW).update(params, grads, state, torch.tensor(0.02), roles, torch.zeros(()))
    assert all(torch.equal(a, b) for a, b in zip(params, before[0]))
    assert all(torch.equal(a, b) for a, b in zip(state["exp_avg"], before[1]))
    assert state["step"].item() == 0


@pytest.mark.parametrize("config", ["tiny_gpt", pytest.param("tiny_moe", marks=pytest.mark.e2e)])  # moe: make e2e
def test_muon_trains_checkpoints_and_resumes_through_run_compiled(config, tmp_path):
    cfg = override(load(ROOT / "configs" / f"{config}.py"),
                   ["optim.optimizer=muon", "train.device=cpu", "data.source=mock", "train.eval_interval=0",
                    "optim.lr=0.02", "optim.warmup_steps=0", "train.steps=6",
                    # inductor under make e2e; the user-path matrix's muon_tp_sp builds it through run.py
                    *inductor_in_e2e()])
    run = Run(cfg)
    assert isinstance(run.optimizer, Muon)
    first = [run.do_step()["loss"] for _ in range(3)]
    run.save(str(tmp_path / "ckpt"))
    after = [run.do_step()["loss"] for _ in range(3)]
    resumed = Run(cfg)
    assert resumed.resume(str(tmp_path / "ckpt")) and resumed.step == 3
    # the momentum came back from the checkpoint: the resumed steps are the same steps, bit for bit
    assert [resumed.do_step()["loss"] for _ in range(3)] == after
    assert after[-1] < first[0]


@pytest.mark.parametrize("config,mesh,flat", [("tiny_gpt", "dp=2", False), ("tiny_gpt", "pp=2", False),
                                              ("tiny_gpt", "cp=2", False), ("tiny_moe", "dp=2,ep=2", False),
                                              ("tiny_gpt", "tp=2", False), ("tiny_gpt", "fsdp=2", False),
                                              ("tiny_gpt", "dp=2", True)])
def test_every_layout_is_accepted(config, mesh, flat):
    cfg = override(load(ROOT / "configs" / f"{config}.py"),
                   ["optim.optimizer=muon", "train.micro_batch_size=2", f"parallel.mesh={mesh}", "parallel.zero=1",
                    f"parallel.distributed_optimizer={str(flat).lower()}"])
    assert preflight(cfg, model_for(cfg.model), torch.device("cpu")) is not None


def test_the_plan_counts_the_gathers_against_the_owner_scheme_minimum():
    def estimate(*sets):
        cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), ["train.micro_batch_size=2", *sets])
        return estimate_plan(cfg, run_plan(cfg, model_for(cfg.model)))

    est = estimate("optim.optimizer=muon", "parallel.mesh=dp=2,tp=2", "parallel.zero=1")
    gathered = sum(t.op_bytes.get("muon_all_gather", 0.0) for t in est.traffic.values())
    # a rank's slice s of each matrix: dp's gather sends s, tp's 2s; the owner scheme 2 x 3/4 x s
    # on 4 ranks: W/2 = 2 times less
    assert est.matrix_minimum > 0 and gathered == 2 * est.matrix_minimum
    assert "muon_all_gather" in "\n".join(traffic_table(est))
    for sets in (["optim.optimizer=adamw", "parallel.mesh=dp=2,tp=2", "parallel.zero=1"],
                 ["optim.optimizer=muon", "parallel.mesh=dp=2"]):  # AdamW; Muon on whole matrices
        est = estimate(*sets)
        assert est.matrix_minimum == 0 and not any("muon_all_gather" in t.ops for t in est.traffic.values())
