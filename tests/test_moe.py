"""Mixture of experts, layer by layer: the router and its balancing terms against
straightforward per-token references, the expert-bias update, dropless and capacity-bound
experts against a dense loop over experts (values and gradients, float64), and the
auxiliary loss reaching the gradient through a block's output."""

from __future__ import annotations

import math

import pytest
import torch

from fxmega.core.errors import ConfigError
from fxmega.ops import aux_loss, experts, routing
from fxmega.ops.moe import MoE, moe_ffn
from fxmega.training.optim import sign_update_

E, K, D, F = 6, 2, 8, 12


def _weights(seed: int = 0, dtype=torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(D, E, generator=g, dtype=dtype),
            "w_gate": torch.randn(E, D, F, generator=g, dtype=dtype) / math.sqrt(D),
            "w_up": torch.randn(E, D, F, generator=g, dtype=dtype) / math.sqrt(D),
            "w_down": torch.randn(E, F, D, generator=g, dtype=dtype) / math.sqrt(F)}


def _reference_route(x, w, moe: MoE, bias=None):
    """One token at a time, as the papers write it."""
    chosen, weights = [], []
    for row in x:
        logits = row @ w
        probs = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
        choice = probs + (bias if bias is not None else 0)
        if moe.n_groups > 1:
            size = E // moe.n_groups
            groups = [sorted(choice[i * size:(i + 1) * size].tolist(), reverse=True)[:2] for i in range(moe.n_groups)]
            best = sorted(range(moe.n_groups), key=lambda i: -sum(groups[i]))[:moe.topk_groups]
            choice = torch.tensor([c if i // size in best else -math.inf for i, c in enumerate(choice.tolist())])
        top = sorted(range(E), key=lambda i: -choice[i])[:moe.top_k]
        wts = probs[top]
        if moe.norm_topk:
            wts = wts / wts.sum()
        chosen.append(top)
        weights.append(wts * moe.route_scale)
    return torch.tensor(chosen), torch.stack(weights)


@pytest.mark.parametrize("moe", [
    MoE(n_experts=E, top_k=K),  # Mixtral
    MoE(n_experts=E, top_k=K, norm_topk=False),  # Qwen2-MoE
    MoE(n_experts=E, top_k=K, score="sigmoid", n_groups=3, topk_groups=2, route_scale=2.5),  # DeepSeek-V3
])
def test_router_equals_per_token_reference(moe):
    torch.manual_seed(0)
    x = torch.randn(16, D, dtype=torch.float64)
    w = _weights()["router"]
    bias = torch.randn(E, dtype=torch.float64) * 0.1 if moe.score == "sigmoid" else None
    r = routing.route(x, w, moe, bias)
    want_experts, want_weights = _reference_route(x, w, moe, bias)
    assert torch.equal(r.experts.sort(-1).values, want_experts.sort(-1).values)
    # float64 throughout: a softmax over E and a matmul over D, far inside 1e-12
    torch.testing.assert_close(r.weights.gather(-1, r.experts.argsort(-1)),
                               want_weights.gather(-1, want_experts.argsort(-1)), rtol=0, atol=1e-12)
    if bias is not None:  # the bias changes the choice but not the weights' source
        unbiased = routing.route(x, w, moe)
        assert not torch.equal(unbiased.experts.sort(-1).values, r.experts.sort(-1).values)


def test_balancing_and_z_loss_equal_reference():
    moe = MoE(n_experts=E, top_k=K)
    torch.manual_seed(1)
    b, s = 3, 10
    x = torch.randn(b * s, D, dtype=torch.float64)
    valid = torch.ones(b, s)
    valid[2, 7:] = 0  # the last sequence's last 3 tokens are padding
    r = routing.route(x, _weights()["router"].double(), moe)
    got = routing.balancing_loss(r, b, moe, valid)
    got_z = routing.z_loss(r, b, valid)
    for i in range(b):
        rows = [i * s + j for j in range(s) if valid[i, j]]
        t = len(rows)
        load = [sum(int(e in r.experts[row].tolist()) for row in rows) / (t * K) for e in range(E)]
        mean_prob = [sum(float(r.probs[row, e]) for row in rows) / t for e in range(E)]
        want = E * sum(f * p for f, p in zip(load, mean_prob))  # Switch: N x sum f_i P_i (top-k: f over k t picks)
        want_z = sum(float(torch.logsumexp(r.logits[row], -1)) ** 2 for row in rows) / t
        # float64: sums of at most E x 10 terms of order 1-30, far inside 1e-10
        assert abs(float(got[i]) - want) < 1e-10 and abs(float(got_z[i]) - want_z) < 1e-10
    # a router that sends every token to the same k experts with all the probability scores E / k
    skew = routing.Routing(torch.tensor([[0, 1]] * s), torch.full((s, K), 0.5),
                           torch.tensor([[0.5, 0.5] + [0.0] * (E - 2)] * s), torch.zeros(s, E))
    assert float(routing.balancing_loss(skew, 1, moe)) == pytest.approx(E / K)


def test_expert_bias_moves_load_toward_balance():
    moe = MoE(n_experts=E, top_k=K, score="sigmoid")
    torch.manual_seed(2)
    x = torch.randn(512, D) + 1.0  # a shifted input: a few experts take most tokens
    w = torch.randn(D, E)
    bias = torch.zeros(E)

    def imbalance(b):
        counts = routing.expert_counts(routing.route(x, w, moe, b).experts, E)
        return float(counts.max() / counts.mean())

    start = imbalance(bias)
    for _ in range(200):
        counts = routing.expert_counts(routing.route(x, w, moe, bias).experts, E)
        sign_update_([bias], [counts], [1e-2], torch.ones(()))  # the step's own update
    assert start > 2.0 and imbalance(bias) < 1.25, (start, imbalance(bias))


def _dense_loop(x, chosen, weights, p, drop=None):
    """Every token through each of its experts one at a time (``drop``: pairs to skip)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            if drop is not None and drop[t, j]:
                continue
            e = int(chosen[t, j])
            hidden = torch.nn.functional.silu(x[t] @ p["w_gate"][e]) * (x[t] @ p["w_up"][e])
            out[t] += weights[t, j] * (hidden @ p["w_down"][e])
    return out


def _routed(seed=3, t=20):
    torch.manual_seed(seed)
    p = {k: v.requires_grad_(True) for k, v in _weights(seed).items()}
    x = torch.randn(t, D, dtype=torch.float64, requires_grad=True)
    r = routing.route(x, p["router"], MoE(n_experts=E, top_k=K))
    return p, x, r


def test_dropless_equals_dense_loop_values_and_gradients():
    p, x, r = _routed()
    leaves = [x, p["w_gate"], p["w_up"], p["w_down"], p["router"]]
    got = experts.dropless(x, r.experts, r.weights.double(), p["w_gate"], p["w_up"], p["w_down"])
    want = _dense_loop(x, r.experts, r.weights.double(), p)
    grad_out = torch.randn_like(want)
    got_grads = torch.autograd.grad(got.out, leaves, grad_out, retain_graph=True)  # the router graph is shared
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    # float64: matmuls over D and F and k terms per token, far inside 1e-12
    torch.testing.assert_close(got.out, want, rtol=0, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    assert float(got.dropped) == 0


def test_capacity_mode_equals_dropless_with_room_and_drops_over_it():
    p, x, r = _routed(t=24)
    groups = 2  # two sequences of 12 tokens
    xs, chosen, weights = x.view(groups, 12, D), r.experts.view(groups, 12, K), r.weights.double().view(groups, 12, K)
    most = int(max(routing.expert_counts(chosen, E).max(), 1))
    roomy = experts.with_capacity(xs, chosen, weights, p["w_gate"], p["w_up"], p["w_down"], most)
    flat = experts.dropless(x, r.experts, r.weights.double(), p["w_gate"], p["w_up"], p["w_down"])
    torch.testing.assert_close(roomy.out.view(-1, D), flat.out, rtol=0, atol=1e-12)
    assert float(roomy.dropped) == 0
    # one row per expert per sequence: GShard's order decides who stays (first choices,
    # then second choices, each in token order)
    tight = experts.with_capacity(xs, chosen, weights, p["w_gate"], p["w_up"], p["w_down"], 1)
    for g in range(groups):
        seen, drop = set(), torch.zeros(12, K, dtype=torch.bool)
        for j in range(K):
            for t in range(12):
                e = int(chosen[g, t, j])
                drop[t, j] = e in seen
                seen.add(e)
        want = _dense_loop(xs[g], chosen[g], weights[g], p, drop)
        torch.testing.assert_close(tight.out[g], want, rtol=0, atol=1e-12)
    assert float(tight.dropped) == groups * 12 * K - sum(len(set(chosen[g].flatten().tolist())) for g in range(2))
    assert experts.capacity(4096, 2, 8, 1.25) == 1280


def test_auxiliary_loss_reaches_the_gradient_scaled():
    """``moe_ffn``'s balancing and z terms join the gradient as ``scale x sum over tokens``,
    and only under a training step's scale."""
    moe = MoE(n_experts=E, top_k=K, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    p = {k: v.requires_grad_(True) for k, v in _weights(4).items()}
    x = torch.randn(2, 5, D, dtype=torch.float64)
    scale = torch.tensor(0.1, dtype=torch.float64)
    with aux_loss.gradient_scale(scale):
        got = torch.autograd.grad(moe_ffn(p, x, moe).sum() * scale, p["router"])[0]
    plain = moe_ffn(p, x, MoE(n_experts=E, top_k=K))
    r = routing.route(x.reshape(10, D), p["router"], moe)
    aux = 5 * (0.01 * routing.balancing_loss(r, 2, moe) + 0.001 * routing.z_loss(r, 2)).sum()
    want = torch.autograd.grad((plain.sum() + aux) * scale, p["router"])[0]
    # float64: the same terms summed in another order, far inside 1e-12 relative
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    # outside a step (evaluation) nothing is attached: the plain gradient
    bare = torch.autograd.grad(moe_ffn(p, x, moe).sum() * scale, p["router"])[0]
    assert not torch.allclose(bare, got)


def test_dropless_compiles_to_one_graph():
    p, x, r = _routed()
    fn = torch.compile(experts.dropless, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    out = fn(x.detach(), r.experts, r.weights.detach().double(), p["w_gate"].detach(), p["w_up"].detach(),
             p["w_down"].detach())
    torch.testing.assert_close(out.out, experts.dropless(x, r.experts, r.weights.double(), p["w_gate"], p["w_up"],
                                                         p["w_down"]).out.detach(), rtol=0, atol=1e-12)


def test_refusals():
    with pytest.raises(ConfigError, match=r"top_k=3 of n_experts=2"):
        MoE(n_experts=2, top_k=3).validate()
    with pytest.raises(ConfigError, match=r"n_groups=4 does not divide n_experts=6"):
        MoE(n_experts=6, n_groups=4).validate()
    with pytest.raises(ConfigError, match=r"the 1 best groups hold 2 experts, fewer than top_k=4"):
        MoE(n_experts=8, top_k=4, n_groups=4, topk_groups=1).validate()
    with pytest.raises(ConfigError, match=r"score='relu'"):
        MoE(n_experts=8, score="relu").validate()
