"""What the host does with a step's metrics once the compiled step has run: the loss and
gradient norm as numbers, the fp16 loss scaler's update (an overflow skips the step and
lowers the scale, expected now and then), and the non-finite policy (``skip``: say so and
go on; ``stop``: write which gradients went bad where, and stop with an error). Shared by
the training loop and fine-tuning, so both treat a bad step the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from fxmega.core.errors import NonFiniteError
from fxmega.ops.aux_loss import router_report
from fxmega.training.state import TrainState


def nonfinite_report(metrics: dict[str, torch.Tensor], step: int, local_paths: list[str], rank: int) -> dict:
    """What a non-finite step looked like on this rank: which local gradients went bad."""
    bad = metrics["nonfinite_grads"].tolist()
    return {"step": step, "rank": rank, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "nonfinite_gradients": [p for p, b in zip(local_paths, bad) if b], "torch": torch.__version__}


def settle(state: TrainState, metrics: dict[str, torch.Tensor], lr: float, loss_scale: float | None, *,
           policy: str, diagnostics_dir: str, local_paths: list[str], rank: int,
           say: Callable[[str], None]) -> dict[str, float]:
    """``state`` after the step that gave ``metrics`` (its counters are updated; the step
    itself is already counted): returns ``loss``, ``lr``, ``grad_norm`` (and ``loss_scale``,
    ``skipped``). ``say`` prints on the ranks that speak (rank 0)."""
    out = {"loss": float(metrics["loss"]), "lr": lr, "grad_norm": float(metrics["grad_norm"])}
    if "router" in metrics:  # a mixture of experts: its routers' statistics
        out |= router_report(metrics["router"])
    finite = bool(metrics["finite"])
    if state.scaler is not None:
        state.scaler.update(finite)
        out["loss_scale"] = loss_scale
        if not finite:  # fp16: an overflow, expected now and then; not a stop
            state.skipped_steps += 1
            out["skipped"] = True
            say(f"step {state.step}: fp16 gradients overflowed at loss scale {loss_scale:g}: the update was skipped; "
                f"loss scale now {state.scaler.scale:g} ({state.skipped_steps} skipped so far)")
            return out
    if finite:
        return out
    # the compiled step did not apply the update; every rank sees it (the norm is global)
    report = nonfinite_report(metrics, state.step, local_paths, rank)
    state.skipped_steps += 1
    out["skipped"] = True
    if policy == "skip":
        say(f"warning: step {state.step}: non-finite loss or gradient (loss {report['loss']}); the update was "
            f"skipped ({state.skipped_steps} skipped so far; train.nonfinite=skip)")
        return out
    folder = Path(diagnostics_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"nonfinite_step{state.step:08d}_rank{rank}.json"
    path.write_text(json.dumps(report, indent=1))
    bad = report["nonfinite_gradients"]
    raise NonFiniteError(f"step {state.step}: non-finite loss or gradient (loss {report['loss']}, gradient norm "
                         f"{report['grad_norm']}); {len(bad)} gradients on rank {rank} are not finite, first "
                         f"{bad[:3]}; the update was not applied. Diagnostics: {path}. Resume from the last "
                         f"checkpoint with a lower --lr, or set train.nonfinite=skip to drop such steps")
