"""The functional AdamW and clipping equal torch.optim.AdamW and clip_grad_norm_."""

import torch

from fxmega.models import gpt
from fxmega.training.optim import AdamWHyper, adamw_init, adamw_update, clip_by_global_norm_, decay_mask
from tests.tolerance import EPS32


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
