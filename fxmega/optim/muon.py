"""Muon (Keller Jordan, 2024; "Muon is scalable for LLM training", Moonshot 2025), behind the
optimizer interface, for the hidden matrices; AdamW for everything else.

For each hidden matrix (``ParamRole.matrix``: each expert and each of Q, K and V its own),
with ``torch.optim.Muon``'s arithmetic:

    B <- lerp(B, g, 1 - mu)                      momentum (an average of gradients)
    U <- lerp(g, B, mu)                          Nesterov (``nesterov=False``: U <- B)
    O <- NS5(U / ||U||_F)                        5 Newton-Schulz steps, quintic (a, b, c)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O

``NS5`` pushes every singular value of U towards 1 (roughly U V^T of U's SVD). Its output
has RMS ~ 1/sqrt(max(A, B)) for an A x B matrix, so the factor 0.2 sqrt(max(A, B)) brings
the update to AdamW's typical RMS of ~0.2 (Moonlight's ``match_rms_adamw``): AdamW's
learning rate and weight decay carry over, and the tables, norms and biases, which AdamW
updates in the same step, share them.

Newton-Schulz runs in bf16 on CUDA (tensor cores; its iterates are robust to bf16
rounding, as Keller's and ``torch.optim.Muon``'s do) and in fp32 elsewhere: a CPU's bf16
matrix product has no fast path without AMX and is slower than fp32, and fp32 is what the
float64 reference checks.

State: ``exp_avg`` holds Muon's momentum for a matrix and AdamW's first moment otherwise;
``exp_avg_sq`` is AdamW's second moment (kept, zero, for the matrices, so that both
optimizers share one state layout that ZeRO shards and checkpoints carry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxmega.config import OptimConfig
from fxmega.optim.adamw import AdamWHyper, adamw_update
from fxmega.optim.optimizer import ParamRole, StateSpec

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: the largest slope at 0 that still converges
NS_EPS = 1e-7  # what the Frobenius norm is clamped to: a zero update stays zero, not NaN


@dataclass(frozen=True)
class MuonHyper:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    weight_decay: float = 0.1


def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of each matrix of ``u`` ([n, A, B]), in
    ``dtype``. Worked on the wide orientation (A <= B), so the Gram matrix is the smaller."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)  # every singular value <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def ns_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def rms_scale(rows: int, cols: int) -> float:
    """Moonlight's factor: brings an orthogonalised A x B update to AdamW's RMS."""
    return 0.2 * max(rows, cols) ** 0.5


def orthogonalised(directions: list[torch.Tensor], roles: list[ParamRole], steps: int) -> list[torch.Tensor]:
    """NS5 of each direction, seen as its role's matrices, each scaled by ``rms_scale``.
    A direction sliced over ranks is gathered whole first and this rank's part taken from
    the result (``ParamRole.pieces``: every rank of the slicing groups orthogonalises the
    same whole matrix). Matrices of one shape go through one batched iteration (fewer,
    larger kernels)."""
    directions = [d if r.pieces is None else r.pieces.gather(d) for d, r in zip(directions, roles)]
    stacks = [r.matrix.to_matrices(d) for d, r in zip(directions, roles)]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for k, m in enumerate(stacks):
        by_shape.setdefault(tuple(m.shape[1:]), []).append(k)
    out: list[torch.Tensor] = list(directions)
    for (rows, cols), members in by_shape.items():
        batch = torch.cat([stacks[k] for k in members])
        ortho = newton_schulz(batch, steps, ns_dtype(batch.device)).to(batch.dtype) * rms_scale(rows, cols)
        for k, part in zip(members, ortho.split([stacks[k].shape[0] for k in members])):
            out[k] = roles[k].matrix.from_matrices(part, tuple(directions[k].shape))
    return [o if r.pieces is None else r.pieces.narrow(o) for o, r in zip(out, roles)]


def muon_update(params: list[torch.Tensor], grads: list[torch.Tensor], state: dict, lr: torch.Tensor,
                hp: MuonHyper, adamw: AdamWHyper, roles: list[ParamRole], apply: torch.Tensor) -> None:
    """One step: Muon on the parameters whose role is a matrix, AdamW (``adamw``) on the rest,
    in place (donated). ``apply`` 0 leaves every parameter and buffer as it was."""
    matrices = [k for k, r in enumerate(roles) if r.matrix is not None]
    others = [k for k, r in enumerate(roles) if r.matrix is None]
    pick = lambda items, ks: [items[k] for k in ks]  # noqa: E731
    if others:  # AdamW counts the step
        adamw_update(pick(params, others), pick(grads, others),
                     {"step": state["step"], "exp_avg": pick(state["exp_avg"], others),
                      "exp_avg_sq": pick(state["exp_avg_sq"], others)},
                     lr, adamw, [roles[k].decay for k in others], apply)
    else:
        state["step"].add_(apply)
    if not matrices:
        return
    weights, buffers = pick(params, matrices), pick(state["exp_avg"], matrices)
    grads = [torch.where(apply > 0, g, 0.0) for g in pick(grads, matrices)]  # 0 x NaN cannot leak in
    torch._foreach_lerp_(buffers, grads, (1 - hp.momentum) * apply)
    directions = [g.lerp(b, hp.momentum) for g, b in zip(grads, buffers)] if hp.nesterov else buffers
    updates = orthogonalised(directions, pick(roles, matrices), hp.ns_steps)
    decayed = [w for w, k in zip(weights, matrices) if roles[k].decay]
    if decayed and hp.weight_decay:
        torch._foreach_mul_(decayed, 1 - lr * hp.weight_decay * apply)
    torch._foreach_sub_(weights, torch._foreach_mul(updates, lr * apply))


@dataclass(frozen=True)
class Muon:
    """Muon for the hidden matrices and AdamW for the rest, both at ``optim.lr`` and
    ``optim.weight_decay``."""

    hyper: MuonHyper
    adamw: AdamWHyper
    name: str = "muon"
    whole_matrices: bool = True
    state: tuple[StateSpec, ...] = (StateSpec("exp_avg"), StateSpec("exp_avg_sq"))

    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor], state: dict, lr: torch.Tensor,
               roles: list[ParamRole], apply: torch.Tensor) -> None:
        muon_update(params, grads, state, lr, self.hyper, self.adamw, roles, apply)


def from_config(cfg: OptimConfig) -> Muon:
    return Muon(MuonHyper(cfg.muon_momentum, cfg.muon_nesterov, cfg.muon_ns_steps, cfg.weight_decay),
                AdamWHyper(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay))
