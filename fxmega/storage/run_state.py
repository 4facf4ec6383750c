"""A run's checkpoint contents, and loading them into a run on any mesh.

Tensors go to DCP as one flat dict keyed by parameter path (``params.blocks.3.attn.wo``,
``opt.exp_avg.blocks.3.attn.wo``, ``opt.step``). Sharded runs give DTensors, so DCP writes
each shard once and reshards on load. Everything else goes to ``meta.json``: step,
consumed samples and the data they index, the resolved config, the RNG state.

A vocabulary that tp pads (255 → 256 under tp=2) is stored padded; loading onto a mesh that
pads differently (or not at all) reads those few tensors whole and pads or cuts them.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from fxmega.config import RunConfig, to_dict
from fxmega.core import tree
from fxmega.core.errors import CheckpointError
from fxmega.core.precision import LossScaler
from fxmega.data.tokenizer import Tokenizer, portable
from fxmega.models import family_name
from fxmega.parallel.runtime import Parallel
from fxmega.storage import checkpoint

FORMAT = 1


class HoldsParams(Protocol):
    """What a parameters-only save or load reads: the whole model's spec tree, the part this
    rank holds, its tensors, and the runtime that sharded them (None on one device)."""

    parallel: Parallel | None
    specs: dict
    local_specs: dict
    params: dict


class Described(Protocol):
    """What a run's data says about itself (``meta.json`` records it)."""

    description: str


class RunState(HoldsParams, Protocol):
    """What a full save or load reads and restores: the parameters, the optimizer state,
    the counters, the fp16 loss scaler, and what the run was configured and fed with."""

    cfg: RunConfig
    opt_state: dict
    step: int
    skipped_steps: int
    scaler: LossScaler | None
    data: Described
    tokenizer: Tokenizer | None


def state_names(opt_state: dict) -> list[str]:
    """The optimizer's per-parameter state tensors (``optim.optimizer.StateSpec``) by name:
    everything in its state but the step count."""
    return [k for k in opt_state if k != "step"]


def _targets(run: HoldsParams | RunState, params_only: bool = False) -> dict[str, tuple[torch.Tensor, Any, str]]:
    """fqn -> (this rank's local tensor, its layout or None, kind)."""
    par, paths = run.parallel, tree.paths(run.local_specs)
    lays = par.shards.layouts if par is not None else [None] * len(paths)
    out = {f"params.{p}": (t, lay, "param") for p, t, lay in zip(paths, tree.leaves(run.params), lays)}
    if not params_only:
        out["opt.step"] = (run.opt_state["step"], None, "scalar")
        for k in state_names(run.opt_state):
            # per parameter (the distributed optimizer's segments gathered: a copy, see load_into)
            moments = par.grads.moments_by_param(run.opt_state[k]) if par is not None else run.opt_state[k]
            out |= {f"opt.{k}.{p}": (t, lay, "opt") for p, t, lay in zip(paths, moments, lays)}
    return out


def tensors(run: HoldsParams | RunState, params_only: bool = False,
            targets: dict[str, tuple[torch.Tensor, Any, str]] | None = None) -> dict[str, torch.Tensor]:
    """What DCP saves: local tensors, as DTensors over the mesh when sharded (of ``targets``,
    ``_targets``' answer, when given)."""
    par = run.parallel
    return {fqn: t.detach() if lay is None or par is None else par.shards.as_dtensor(t.detach(), lay, kind)
            for fqn, (t, lay, kind) in (targets or _targets(run, params_only)).items()}


def tokenizer_files(run: RunState) -> tuple[str | None, dict[str, Path]]:
    """The tokenizer spec a checkpoint of ``run`` records, reading its own copies of the
    files, and those files (``fxmega.data.tokenizer.portable``); ``(None, {})`` for a run
    without a tokenizer (synthetic data)."""
    if run.tokenizer is None:
        return None, {}
    return portable(run.cfg.data.tokenizer, run.cfg.data.data_dir)


def meta(run: RunState, params_only: bool = False) -> dict[str, Any]:

    return {
        "format": FORMAT, "step": run.step, "consumed_samples": run.step * run.cfg.train.global_batch_size,
        "data": run.data.description, "config": to_dict(run.cfg), "model_family": family_name(run.cfg.model),
        "mesh": run.parallel.groups.mesh.describe() if run.parallel is not None else "1", "params_only": params_only,
        "rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(), "saved_at": time.time(),
        "skipped_steps": run.skipped_steps,
        "loss_scaler": run.scaler.state_dict() if run.scaler is not None and not params_only else None,
    }


def load_into(run: HoldsParams | RunState, path: Path, params_only: bool = False) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``run`` (this rank's shards), resharding as needed.
    ``params_only`` (or a checkpoint that holds only parameters, e.g. imported from
    Hugging Face) loads the parameters and leaves the optimizer and step fresh."""
    info = checkpoint.check(path)
    params_only = params_only or bool(info.get("params_only"))
    saved_optimizer = info.get("config", {}).get("optim", {}).get("optimizer")
    if not params_only and saved_optimizer is not None and saved_optimizer != run.cfg.optim.optimizer:
        # one optimizer's state read as another's (Muon's momentum as AdamW's first moment) trains on
        # silently wrong; the command line settles it before the run is built (training.checks)
        raise CheckpointError(f"the checkpoint was trained with {saved_optimizer} and this run uses "
                              f"{run.cfg.optim.optimizer}: resume with optim.optimizer={saved_optimizer}, or load the "
                              f"parameters only (--finetune)")
    targets = _targets(run, params_only)
    saved = checkpoint.saved_shapes(path)
    missing = [k for k in targets if k not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no {missing[0]} ({len(missing)} tensors missing): it was saved "
                              f"for a different model ({info.get('model_family')}, "
                              f"{_model_line(info)}); check --config")
    template = tensors(run, params_only, targets)
    reshaped = {}
    for fqn, (t, lay, _) in targets.items():
        want = tuple(lay.shape) if lay is not None else tuple(t.shape)
        if saved[fqn] != want:
            _check_padding(fqn, saved[fqn], want, run)
            template[fqn] = torch.zeros(saved[fqn], dtype=t.dtype)  # read whole, fixed below
            reshaped[fqn] = want
    checkpoint.load(path, template)
    with torch.no_grad():
        for fqn, want in reshaped.items():
            t, lay, kind = targets[fqn]
            full = _pad_or_cut(template[fqn], want)
            t.copy_(run.parallel.shards.shard(full, lay, kind) if lay is not None else full)
        par = run.parallel
        if not params_only and par is not None and par.grads.flat is not None:  # the targets were copies
            paths = tree.paths(run.local_specs)
            for k in state_names(run.opt_state):
                par.grads.moments_from_params([targets[f"opt.{k}.{p}"][0] for p in paths], run.opt_state[k])
    if not params_only:
        run.step = int(info["step"])
        run.skipped_steps = int(info.get("skipped_steps", 0))
        if run.scaler is not None and info.get("loss_scaler"):  # fp16: resume at the scale reached
            run.scaler.load_state_dict(info["loss_scaler"])
        if info.get("rng"):
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(info["rng"])), dtype=torch.uint8))
    return info


def _model_line(info: dict) -> str:
    model = info.get("config", {}).get("model", {})
    return ", ".join(f"{k}={v}" for k, v in model.items() if k in ("vocab_size", "d_model", "n_layers", "n_heads"))


def _check_padding(fqn: str, have: tuple, want: tuple, run: HoldsParams) -> None:
    """Only vocabulary dims may differ (tp padding); anything else is another model."""
    path = fqn.split(".", 1)[1] if fqn.startswith("params.") else fqn.split(".", 2)[2]
    spec = dict(tree.items(run.specs)).get(path)
    ok = spec is not None and len(have) == len(want) and all(
        h == w or spec.axes[i] == "vocab" for i, (h, w) in enumerate(zip(have, want)))
    if not ok:
        raise CheckpointError(f"checkpoint tensor {fqn} has shape {list(have)}, this model's is {list(want)}: the "
                              f"checkpoint is of a different model; check --config (model.*)")


def _pad_or_cut(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``x`` cut or zero-padded to ``shape`` (padding rows of a vocabulary are zero)."""
    x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, shape))]
    pads: list[int] = []
    for have, want in reversed(list(zip(x.shape, shape))):
        pads += [0, want - have]
    return torch.nn.functional.pad(x, pads)
