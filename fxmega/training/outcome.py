"""What the host does with the metrics of steps the device has run: the loss and gradient
norm as numbers, the fp16 overflows (an overflow skips the step and lowers the scale,
expected now and then), and the non-finite policy (``skip``: say so and go on; ``stop``:
write which gradients went bad where, and stop with an error). Shared by the training loop
and fine-tuning, so both treat a bad step the same way.

A step is launched, not waited for: its metrics stay on the device as a ``Pending`` (and
the fp16 scaler has already decided the next scale there). The loop settles the steps
since the last report together, with one device-to-host read (``read``), at the steps it
reports — so between log steps the host never waits for the device, as in nanoGPT."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fxmega.core.errors import NonFiniteError
from fxmega.ops import mtp
from fxmega.ops.aux_loss import ROUTER_STATS, router_report
from fxmega.training.state import TrainState


@dataclass(frozen=True)
class Pending:
    """A step that has been launched: its number (counted from 1), learning rate, the loss
    scale it ran with and the scale after it (fp16; device tensors), and the compiled
    step's metrics, still on the device."""

    step: int
    lr: float
    metrics: dict[str, torch.Tensor]
    loss_scale: torch.Tensor | None = None
    scale_after: torch.Tensor | None = None


def read(pending: list[Pending]) -> list[list[float]]:
    """Per step: loss, grad norm, finite (0/1), the loss scale before and after (0 without
    fp16), then the layers' statistics if any (``meter_names``) — for all ``pending`` in one device-to-host
    copy (fp32: every value is an fp32 tensor, a flag or a power of two)."""
    rows = []
    for p in pending:
        m = p.metrics
        none = m["loss"].new_zeros(())
        scales = [s if s is not None else none for s in (p.loss_scale, p.scale_after)]
        head = torch.stack([m["loss"].float(), m["grad_norm"].float(), m["finite"].float(),
                            *(s.float() for s in scales)])
        rows.append(torch.cat([head, m["meter"].float()]) if "meter" in m else head)
    return torch.stack(rows).tolist() if rows else []  # the one read


def meter_report(names: tuple[str, ...], values: list[float]) -> dict[str, float]:
    """The numbers a log shows from a step's summed meter: the routers' (``router_report``)
    and multi-token prediction's per-depth losses (``mtp.report``)."""
    stats = dict(zip(names, values))
    out = router_report([stats[k] for k in ROUTER_STATS]) if ROUTER_STATS[0] in stats else {}
    return out | mtp.report(stats)


def nonfinite_report(metrics: dict[str, torch.Tensor], step: int, local_paths: list[str], rank: int) -> dict:
    """What a non-finite step looked like on this rank: which local gradients went bad."""
    bad = metrics["nonfinite_grads"].tolist()
    return {"step": step, "rank": rank, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "nonfinite_gradients": [p for p, b in zip(local_paths, bad) if b], "torch": torch.__version__}


def settle(state: TrainState, pending: list[Pending], *, policy: str, diagnostics_dir: str,
           local_paths: list[str], rank: int, say: Callable[[str], None],
           meter_names: tuple[str, ...] = ()) -> list[dict[str, float]]:
    """The outcomes of ``pending`` steps, in order: ``loss``, ``lr``, ``grad_norm`` (and
    ``loss_scale``, ``skipped``, what the layers measured: router statistics, MTP's depth
    losses, named by ``meter_names``); ``state.skipped_steps`` counts the
    dropped ones. Under ``policy="stop"`` the first non-finite step raises, naming it.
    ``say`` prints on the ranks that speak (rank 0)."""
    outcomes = []
    for p, values in zip(pending, read(pending)):
        loss, grad_norm, finite, scale, scale_after = values[:5]
        out = {"loss": loss, "lr": p.lr, "grad_norm": grad_norm}
        if "meter" in p.metrics:  # what the layers measured (aux_loss.measure)
            out |= meter_report(meter_names, values[5:])
        outcomes.append(out)
        if state.scaler is not None:
            out["loss_scale"] = scale
            if not finite:  # fp16: an overflow, expected now and then; not a stop
                state.skipped_steps += 1
                out["skipped"] = True
                say(f"step {p.step}: fp16 gradients overflowed at loss scale {scale:g}: the update was skipped; "
                    f"loss scale now {scale_after:g} ({state.skipped_steps} skipped so far)")
            continue
        if not finite:
            _nonfinite(state, p, out, policy, diagnostics_dir, local_paths, rank, say)
    return outcomes


def _nonfinite(state: TrainState, p: Pending, out: dict, policy: str, diagnostics_dir: str, local_paths: list[str],
               rank: int, say: Callable[[str], None]) -> None:
    # the compiled step did not apply the update; every rank sees it (the norm is global)
    report = nonfinite_report(p.metrics, p.step, local_paths, rank)
    state.skipped_steps += 1
    out["skipped"] = True
    if policy == "skip":
        say(f"warning: step {p.step}: non-finite loss or gradient (loss {report['loss']}); the update was "
            f"skipped ({state.skipped_steps} skipped so far; train.nonfinite=skip)")
        return
    folder = Path(diagnostics_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"nonfinite_step{p.step:08d}_rank{rank}.json"
    path.write_text(json.dumps(report, indent=1))
    bad = report["nonfinite_gradients"]
    raise NonFiniteError(f"step {p.step}: non-finite loss or gradient (loss {report['loss']}, gradient norm "
                         f"{report['grad_norm']}); {len(bad)} gradients on rank {rank} are not finite, first "
                         f"{bad[:3]}; the update was not applied. Diagnostics: {path}. Resume from the last "
                         f"checkpoint with a lower --lr, or set train.nonfinite=skip to drop such steps")
