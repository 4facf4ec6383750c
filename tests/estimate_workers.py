"""Workers for tests/test_estimate.py: measure what a rank really allocates and the peak of
its compiled forward+backward, next to what ``fxmega.planning.estimate`` predicts."""

from __future__ import annotations

import torch

from fxmega.config import load, override
from fxmega.core import tree
from fxmega.models import loss_by_pieces, model_for
from fxmega.ops import aux_loss
from fxmega.parallel import distributed
from fxmega.parallel.strategy import plan_from
from fxmega.planning import estimate
from fxmega.sharding.mesh import MeshSpec
from tests.multirank import ROOT


def config(sets: list[str]):
    """``configs/tiny_gpt.py`` (or the config named by an item ``@tiny_llama``) with ``sets``."""
    name = next((s[1:] for s in sets if s.startswith("@")), "tiny_gpt")
    sets = [s for s in sets if not s.startswith("@")]
    return override(load(ROOT / "configs" / f"{name}.py"), ["train.device=cpu", *sets])


def predicted(cfg, pp_rank: int = 0) -> estimate.MemoryEstimate:
    model = model_for(cfg.model)
    plan = plan_from(model.param_specs(cfg.model), cfg.parallel, model)
    work = estimate.workload_of(cfg, plan.mesh.data_size)
    return estimate.memory(plan, cfg.model, work)[pp_rank]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def state_bytes(sets: list[str]) -> dict:
    """Bytes this rank's parameters, AdamW moments and gradient-accumulation buffers hold
    after one eager step, and the prediction for this rank."""
    from fxmega.training.run import Run

    cfg = config(["train.compile=false", *sets])
    par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
    run = Run(cfg, par, device)
    run.do_step()
    step = run.train_step
    accum = getattr(step, "_accum_buffers", None)
    pred = predicted(cfg, par.groups.coords["pp"])
    return {"params": _nbytes(tree.leaves(run.params)),
            "opt": _nbytes(run.opt_state["exp_avg"]) + _nbytes(run.opt_state["exp_avg_sq"]),
            "grads": _nbytes(accum) if accum is not None else None,
            "pred": {"params": pred.params, "opt": pred.opt, "grads": pred.grads}}


def step_peak(sets: list[str]) -> dict:
    """The peak a compiled (inductor) forward+backward adds above the resident set before it
    (the second call: the first compiles), and the predicted activations + transient."""
    from fxmega.core.memory import current_bytes, peak_bytes, reset_peak
    from fxmega.ops.recompute import inductor_options
    from fxmega.training.evaluate import my_micro_batches
    from fxmega.training.run import Run
    from fxmega.training.step import compiled, enable_autograd_in_compile

    torch.set_num_threads(1)
    cfg = config(["train.compile=false", *sets])
    mesh = MeshSpec.parse(cfg.parallel.mesh)
    par, device = distributed.setup(cfg, mesh) if mesh.world_size > 1 else (None, torch.device("cpu"))
    run = Run(cfg, par, device)
    flat = tree.leaves(run.params)
    loss_sum = par.loss_sum_fn(loss_by_pieces(cfg.model, par.compute)) if par is not None else \
        run.loss_sum
    batch = run.train_data.global_batch(0, cfg.train.micro_batch_size * mesh.data_size)
    if par is not None:
        batch = my_micro_batches(batch, cfg.train.micro_batch_size, par, device)[0]
    enable_autograd_in_compile()

    def loss_and_grads(flat: list[torch.Tensor], batch: dict, inv_tokens: torch.Tensor) -> tuple:
        with aux_loss.gradient_scale(inv_tokens):  # as the step: MoE layers add their balancing terms
            loss = loss_sum(flat, batch)
        return loss.detach(), torch.autograd.grad(loss, flat)

    fn = compiled(loss_and_grads, options=inductor_options(cfg.compute.recompute != "none"))
    inv_tokens = torch.tensor(1.0 / batch["targets"].numel(), device=device)
    fn(flat, batch, inv_tokens)
    reset_peak(device)
    before = current_bytes(device)
    out = fn(flat, batch, inv_tokens)
    measured = peak_bytes(device) - before
    del out
    pred = predicted(cfg, par.groups.coords["pp"] if par is not None else 0)
    return {"measured": measured, "predicted": pred.activations + pred.transient + pred.compute_copy,
            "activations": pred.activations, "transient": pred.transient}


if __name__ == "__main__":  # python -m tests.estimate_workers [--pipeline] WORLD SETS...: per rank, as JSON
    import json
    import os
    import sys

    from tests.multirank import run_ranks

    args = sys.argv[1:]
    worker = "pipeline_step_peak" if args[0] == "--pipeline" else "step_peak"
    args = args[1:] if args[0] == "--pipeline" else args
    world = int(args[0])
    result = [step_peak(args[1:])] if world == 1 else run_ranks(world, f"tests.estimate_workers:{worker}", args[1:])
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def pipeline_step_peak(sets: list[str]) -> dict:
    """The peak a whole pipelined step (compiled stages, torch.distributed.pipelining's
    schedule, the update) adds above the resident set before it, and the prediction."""
    from fxmega.core.memory import current_bytes, peak_bytes, reset_peak
    from fxmega.training.run import Run

    torch.set_num_threads(1)
    cfg = config(["train.compile=true", *sets])
    par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
    run = Run(cfg, par, device)
    run.do_step()
    run.do_step()
    reset_peak(device)
    before = current_bytes(device)
    run.do_step()
    measured = peak_bytes(device) - before
    pred = predicted(cfg, par.groups.coords["pp"])
    return {"measured": measured, "predicted": pred.activations + pred.transient + pred.compute_copy,
            "activations": pred.activations, "transient": pred.transient, "in_flight": pred.in_flight}
