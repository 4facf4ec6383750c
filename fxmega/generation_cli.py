"""``run.py generate`` and ``run.py serve``: a checkpoint's model, loaded onto the run's mesh,
generating with a KV cache (``fxmega.generate``; on a tensor-parallel mesh
``fxmega.generate_parallel``), printing completions or serving them over HTTP."""

from __future__ import annotations

import functools
from typing import Any

from fxmega.config import RunConfig
from fxmega.errors import ConfigError
from fxmega.generate import generate_cached
from fxmega.generate_parallel import generate_on_mesh
from fxmega.models import family_name
from fxmega.serve import cut_at_stop, stop_token_ids
from fxmega.train import Run


def load_model(cfg: RunConfig, parallel: Any = None, device: Any = None) -> Any:
    """A ``Run`` holding ``--load``'s parameters (resharded onto the mesh), with a tokenizer."""

    if family_name(cfg.model) == "bert":
        raise ConfigError("generate/serve need a decoder (gpt or llama); BERT is an encoder")
    if not cfg.train.load_dir:
        raise ConfigError("generate/serve need a checkpoint: --load CKPT (a checkpoint root or one step directory)")
    run = Run(cfg, parallel, device)
    if run.tokenizer is None:
        raise ConfigError("generate/serve need a tokenizer to turn text into ids: use the data source and "
                          "data.tokenizer the model was trained with (data.source=mock has none)")
    if not run.resume(cfg.train.load_dir, params_only=True):
        raise ConfigError(f"--load {cfg.train.load_dir}: no checkpoint there")
    return run


def generate_fn(run: Any) -> Any:
    """``(prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, seed) -> new ids``
    for this run: cached generation on one device, or on the run's mesh."""
    if run.parallel is not None:

        return functools.partial(generate_on_mesh, run)

    return functools.partial(generate_cached, run.model, run.params, run.cfg.model)


def generate_texts(run: Any, prompts: list[str], max_new_tokens: int, temperature: float, top_k: int,
                   top_p: float, stops: list[str], seed: int) -> list[str]:
    """Completions of ``prompts`` (text after each prompt, cut at the first stop string)."""

    tok = run.tokenizer
    outs = generate_fn(run)([tok.encode(p) for p in prompts], max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, stop_tokens=stop_token_ids(tok, stops), seed=seed)
    return [cut_at_stop(tok.decode(ids), stops)[0] for ids in outs]
