"""``run.py generate`` and ``run.py serve``: a checkpoint's model, loaded onto the run's mesh,
generating with a KV cache (``fxmega.inference.generate``; on a mesh ``fxmega.inference.generate_parallel``),
printing completions or serving them over HTTP."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from fxmega.config import RunConfig, override
from fxmega.core.errors import ConfigError
from fxmega.inference.generate_parallel import generate_on_mesh
from fxmega.inference.model_loader import LoadedModel, load_model, recorded, recorded_config
from fxmega.inference.seq2seq import WithModelSpecials, ended, generate_seq2seq, is_encoder_decoder
from fxmega.inference.stops import cut_at_stop, stop_token_ids
from fxmega.models import family_name, model_for
from fxmega.parallel.runtime import Parallel
from fxmega.sharding.mesh import MeshSpec


def check_generator(cfg: RunConfig) -> None:
    """Refuse, before any process starts, a model generate/serve cannot run as configured."""
    model = model_for(cfg.model)
    if is_encoder_decoder(model):
        if MeshSpec.parse(cfg.parallel.mesh).world_size > 1:
            raise ConfigError(f"generate/serve run the {family_name(cfg.model)} encoder-decoder on one device; drop "
                              f"--mesh {cfg.parallel.mesh}")
    elif not model.can_decode:
        raise ConfigError(f"generate/serve need a decoder with a KV cache (gpt, llama, mixtral) or an "
                          f"encoder-decoder (t5); the {family_name(cfg.model)} family is neither (BERT is an encoder)")


def load_generator(cfg: RunConfig, parallel: Parallel | None = None,
                   device: torch.device | None = None) -> LoadedModel:
    """``--load``'s parameters (resharded onto the mesh) and the tokenizer, for generating:
    no optimizer state, no data."""
    check_generator(cfg)
    model = model_for(cfg.model)
    run = load_model(cfg, parallel, device, command="generate/serve")
    if is_encoder_decoder(model) and run.tokenizer is not None:
        run.tokenizer = WithModelSpecials(run.tokenizer, cfg.model)  # a target may hold sentinels
    return run


def load_recorded_generator(path: str, device: str = "cpu") -> LoadedModel:
    """``load_generator`` for the checkpoint at ``path`` with the config it records, on one
    ``device``: what the recipes' evaluation scripts start from."""
    cfg = override(recorded_config(*recorded(path)), [f"train.load_dir={path}", f"train.device={device}"])
    return load_generator(cfg)


def generate_fn(run: LoadedModel) -> Callable[..., list[list[int]]]:
    """``(prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, seed) -> new ids``
    for this run: cached generation on one device, or on the run's mesh; for an
    encoder-decoder each prompt is a source and the ids are its target."""
    if is_encoder_decoder(run.model):
        cfg = run.cfg.model

        def seq2seq(sources: list[list[int]], *args: Any, on_token: Callable[[list[int]], None] | None = None,
                    **kwargs: Any) -> list[list[int]]:
            if on_token is not None:
                raise ValueError("streaming is served for decoder-only models; an encoder-decoder's target comes "
                                 "whole: send stream=false")
            return generate_seq2seq(run.model, run.params, cfg, ended(sources, cfg.eos_id), *args, **kwargs)
        return seq2seq
    return functools.partial(generate_on_mesh, run)


DEFAULT_NEW_TOKENS = 64  # generate's --max-new-tokens when the prompts leave room for it


def check_prompts_fit(prompts: list[list[int]], max_new_tokens: int, context: int) -> None:
    """Refuse, naming the flags that fix it, a --prompt that leaves no room in the model's
    ``context`` tokens for ``max_new_tokens`` more."""
    for i, ids in enumerate(prompts, 1):
        if len(ids) + max_new_tokens <= context:
            continue
        if len(ids) >= context:
            raise ConfigError(f"--prompt {i} is {len(ids)} tokens and the model's context holds {context} "
                              f"(model.max_seq_len), with no room for new tokens: shorten the prompt to at most "
                              f"{max(context - max_new_tokens, 1)} tokens for --max-new-tokens {max_new_tokens}")
        raise ConfigError(f"--prompt {i} is {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                          f"{len(ids) + max_new_tokens}, over the model's context of {context} tokens "
                          f"(model.max_seq_len): pass --max-new-tokens {context - len(ids)} or less, or shorten the "
                          f"prompt to at most {max(context - max_new_tokens, 1)} tokens")


def new_tokens_that_fit(prompts: list[list[int]], context: int) -> int:
    """--max-new-tokens left unset: DEFAULT_NEW_TOKENS, or fewer where the longest prompt
    leaves less room in the model's context (a 64-token model asked "ROMEO:" answers with 58,
    not an error); a prompt that fills the context is refused by ``check_prompts_fit``."""
    room = context - max(map(len, prompts))
    return min(DEFAULT_NEW_TOKENS, room) if room > 0 else DEFAULT_NEW_TOKENS


def generate_texts(run: LoadedModel, prompts: list[str], max_new_tokens: int | None, temperature: float, top_k: int,
                   top_p: float, stops: list[str], seed: int) -> list[str]:
    """Completions of ``prompts`` (text after each prompt, cut at the first stop string);
    ``max_new_tokens`` None: as many as fit (``new_tokens_that_fit``)."""

    tok = run.tokenizer
    encoded = [tok.encode(p) for p in prompts]
    if is_encoder_decoder(run.model):
        max_new_tokens = DEFAULT_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    else:
        if max_new_tokens is None:
            max_new_tokens = new_tokens_that_fit(encoded, run.cfg.model.max_seq_len)
        check_prompts_fit(encoded, max_new_tokens, run.cfg.model.max_seq_len)
    outs = generate_fn(run)(encoded, max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, stop_tokens=stop_token_ids(tok, stops), seed=seed)
    return [cut_at_stop(tok.decode(ids), stops)[0] for ids in outs]
