"""Parameters only: a model built for inference from a checkpoint (or from its seeded init),
sharded as the mesh says, with no optimizer moments, no data pipeline and no training step.
``run.py eval``, ``generate``, ``serve`` and ``convert --to-hf`` start from it.

The parameters are allocated empty at this rank's local shapes (its tp/ZeRO shards, its
pipeline stages' blocks) and DCP reads the checkpoint straight into them, resharding from
whatever mesh saved it; nothing is initialised first and nothing is held twice, so loading a
model costs about its parameter bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxmega.config import RunConfig, from_dict
from fxmega.core import tree
from fxmega.core.device import pick_device
from fxmega.core.errors import ConfigError
from fxmega.core.log import get_logger
from fxmega.data.tokenizer import Tokenizer, build_tokenizer, stored_spec
from fxmega.models import model_for
from fxmega.models.family import ModelFamily
from fxmega.ops.init import init_params
from fxmega.parallel.runtime import Parallel
from fxmega.storage import checkpoint, run_state
from fxmega.storage.checkpoint_files import read_meta

log = get_logger(__name__)


@dataclass
class LoadedModel:
    """A model's parameters on this rank, ready to run forward: what inference needs and no
    more. ``specs`` is the whole model's tree, ``local_specs`` and ``params`` what this rank
    holds (all of it on one device; its pipeline stages' blocks and its shards on a mesh)."""

    cfg: RunConfig
    model: ModelFamily
    specs: dict
    local_specs: dict
    params: dict
    parallel: Parallel | None
    device: torch.device
    tokenizer: Tokenizer | None = None
    checkpoint: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def main(self) -> bool:
        """Whether this process is rank 0 (the one that prints)."""
        return self.parallel is None or self.parallel.rank == 0


def empty_params(specs: dict, parallel: Parallel | None, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> dict:
    """Uninitialised tensors at this rank's local shapes (``parallel.specs``' layouts on a
    mesh, the specs' own shapes on one device): for a checkpoint to be read into."""
    if parallel is None:
        return tree.map_leaves(lambda spec: torch.empty(spec.shape, dtype=dtype, device=device), specs)
    return tree.map_leaves(lambda lay: torch.empty(lay.local_shape("param"), dtype=dtype, device=device),
                           parallel.shards.layout_tree)


def recorded(path: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``--load path`` names and its meta (read, not yet verified: loading
    verifies every file)."""
    found = checkpoint.resolve(path)
    if found is None:
        raise ConfigError(f"--load {path}: no checkpoint there (no 'latest' and no step directory)")
    return found, read_meta(found)


def recorded_config(found: Path, meta: dict[str, Any]) -> RunConfig:
    """The run config checkpoint ``found`` records in ``meta`` (``recorded``): a training run's
    whole config; a converted model's model section, the rest at their defaults."""
    saved = meta.get("config")
    if not saved or "model" not in saved:
        raise ConfigError(f"{found} records no model config (a checkpoint written before checkpoints described "
                          f"themselves): give --config FILE with the model it was trained with")
    cfg = from_dict(saved, meta.get("model_family"), where=f"{found / 'meta.json'}")
    if "train" not in saved:  # a converted model: sequences as long as its context, not the default
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=cfg.model.max_seq_len))
    return cfg if "name" in saved else dataclasses.replace(cfg, name=found.parent.name)


def recorded_tokenizer(found: Path, meta: dict[str, Any]) -> str | None:
    """The tokenizer spec to read checkpoint ``found``'s text with: the one it recorded (its
    own copies of the files), else the one its saved run config names; None when it says
    nothing (a model converted before checkpoints recorded their tokenizer)."""
    if meta.get("tokenizer"):
        return stored_spec(meta["tokenizer"], found)
    data = (meta.get("config") or {}).get("data")
    return data.get("tokenizer") if isinstance(data, dict) else None


def init_model(cfg: RunConfig, parallel: Parallel | None = None, device: torch.device | None = None,
               with_tokenizer: bool = False) -> LoadedModel:
    """``cfg.model``'s parameters from its seeded init (``train.seed``), sharded as
    ``parallel`` says and equal to the slice of the one-device init: a model to generate from
    or measure without a checkpoint, still with no optimizer state and no data."""
    model = model_for(cfg.model)
    specs = model.param_specs(cfg.model)
    device = device or pick_device(cfg.train.device)
    if parallel is None:
        params, local = init_params(specs, cfg.train.seed, device), specs
    else:
        params = tree.map_leaves(lambda t: t.detach(), parallel.shards.init_params(cfg.train.seed, device))
        local = parallel.specs
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.data_dir) if with_tokenizer else None
    return LoadedModel(cfg, model, specs, local, params, parallel, device, tokenizer)


def load_model(cfg: RunConfig, parallel: Parallel | None = None, device: torch.device | None = None,
               path: str | None = None, with_tokenizer: bool = True, command: str = "this command") -> LoadedModel:
    """``cfg.model``'s parameters from the checkpoint at ``path`` (default ``train.load_dir``:
    a checkpoint root or one step directory), on one device or this rank's shards of them,
    with the tokenizer ``cfg.data.tokenizer`` names (``with_tokenizer``). Every rank calls;
    ``command`` names the caller in errors."""
    path = path or cfg.train.load_dir
    if not path:
        raise ConfigError(f"{command} needs a checkpoint: --load CKPT (a checkpoint root or one step directory)")
    found = checkpoint.resolve(path)
    if found is None:
        raise ConfigError(f"--load {path}: no checkpoint there (no 'latest' and no step directory)")
    if with_tokenizer and not cfg.data.tokenizer:
        raise ConfigError(f"{found} records no tokenizer (converted before checkpoints recorded one): give the "
                          f"tokenizer the model was trained with, e.g. --tokenizer gpt2 (GPT-2), --tokenizer "
                          f"hf:DIR/tokenizer.json (Llama, from the model's Hugging Face directory)")
    model = model_for(cfg.model)
    specs = model.param_specs(cfg.model)
    local = specs if parallel is None else parallel.specs
    device = device or pick_device(cfg.train.device)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.data_dir) if with_tokenizer else None
    if tokenizer is not None and cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the {tokenizer.name} tokenizer's "
                          f"{tokenizer.vocab_size:,} tokens: this is not the tokenizer the model was trained with; "
                          f"set data.tokenizer (--tokenizer) to that one")
    loaded = LoadedModel(cfg, model, specs, local, empty_params(local, parallel, device), parallel, device, tokenizer,
                         found)
    with torch.no_grad():
        loaded.meta = run_state.load_into(loaded, found, params_only=True)
    if loaded.main:
        log.info(f"loaded the parameters of {found}")
    return loaded
