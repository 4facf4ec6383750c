"""Generation with the KV cache on a mesh (``fxmega.inference.generate_parallel``): on 2 gloo ranks,
greedy decoding from the sharded parameters gives token for token what one device gives from
the same seed's parameters — under tp for GPT and grouped-query Llama, batched prompts of
different lengths and a vocabulary that tp pads (255 -> 256), each rank caching half the
heads; under pp with one and with two stages per rank, each rank caching only its stages'
blocks — and every rank returns the same tokens, sampled and stopped ones included. Meshes
without tp (ZeRO-3 on dp), with tp next to ZeRO-3 or pp next to tp (4 ranks) and no mesh at
all give the same tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxmega.config import ParallelConfig, load, override
from fxmega.inference.generate import LocalDecoder, generate_cached
from fxmega.inference.generate_parallel import MeshDecoder, generate_on_mesh
from fxmega.models import model_for
from fxmega.ops.init import init_params
from fxmega.parallel import distributed
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.multirank import ROOT, run_ranks

PROMPTS = [[5, 17, 99, 3, 42, 42, 7, 200, 11], [65], [1, 2, 3, 4]]
NEW = 8
# name -> (config file, overrides, parallel config)
CASES = {
    "gpt_tp2": ("tiny_gpt", (), dict(mesh="tp=2")),
    "gpt_tp2_vocab255": ("tiny_gpt", ("model.vocab_size=255",), dict(mesh="tp=2")),
    "llama_gqa_tp2": ("tiny_llama", ("model.n_kv_heads=2",), dict(mesh="tp=2")),
    "llama_gqa_tp2_sp_vocab255": ("tiny_llama", ("model.n_kv_heads=2", "model.vocab_size=255"),
                                  dict(mesh="tp=2", sequence_parallel=True)),
    "gpt_zero3_dp2": ("tiny_gpt", (), dict(mesh="dp=2", rules="zero3")),
    "gpt_pp2": ("tiny_gpt", ("train.micro_batch_size=2",), dict(mesh="pp=2")),
    "llama_pp2_two_stages_each": ("tiny_llama", ("model.n_layers=4", "train.micro_batch_size=2"),
                                  dict(mesh="pp=2", virtual_stages=2, pipeline_schedule="interleaved-1f1b")),
}
# on 4 ranks: tp next to ZeRO-3 over dp (parameters gathered over dp, kept split over tp), and
# tp inside each of two pipeline stages
FOUR_RANKS = {"llama_zero3_dp2_tp2": ("tiny_llama", ("model.vocab_size=255",), dict(mesh="dp=2,tp=2", rules="zero3")),
              "gpt_pp2_tp2": ("tiny_gpt", ("model.vocab_size=255", "train.micro_batch_size=2"),
                              dict(mesh="pp=2,tp=2"))}


def config(name: str):
    file, extra, parallel = {**CASES, **FOUR_RANKS}[name]
    # a larger init than training's, so that greedy decoding of an untrained model gives varied tokens
    cfg = override(load(ROOT / "configs" / f"{file}.py"),
                   ["train.compile=false", "train.device=cpu", "train.micro_batch_size=4", "model.init_std=0.3",
                    *extra])
    return dataclasses.replace(cfg, parallel=ParallelConfig(**parallel))


def single_device(name: str, **kwargs) -> list[list[int]]:
    """``generate_cached`` on one device from the same seed's (unpadded) parameters."""
    cfg = config(name)
    model = model_for(cfg.model)
    params = init_params(model.param_specs(cfg.model), seed=cfg.train.seed)
    return generate_cached(model, params, cfg.model, PROMPTS, NEW, **kwargs)


def on_four_ranks() -> dict[str, list[list[int]]]:
    out = {}
    for name in FOUR_RANKS:
        cfg = config(name)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        out[name] = generate_on_mesh(Run(cfg, par, device), PROMPTS, NEW)
    return out


def on_ranks() -> dict:
    """Per case: greedy, stopped and sampled tokens from ``generate_on_mesh``, and under tp the local
    cache shape and the gap between the prefill's logits and one device's."""
    out = {}
    for name in CASES:
        cfg = config(name)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        greedy = generate_on_mesh(run, PROMPTS, NEW)
        # every rank must see the same stops, or one would wait in a collective the others skip
        result = {"greedy": greedy, "stopped": generate_on_mesh(run, PROMPTS, NEW, stop_tokens=[greedy[0][3]]),
                  "sampled": generate_on_mesh(run, PROMPTS, NEW, temperature=1.0, top_p=0.9, seed=3)}
        decoder = MeshDecoder(run.model, par, run.params, cfg.model)
        result["cached_blocks"] = sorted(decoder.init_cache(1, 4))
        if par.groups.tp > 1:
            longest = max(map(len, PROMPTS))
            pad = torch.tensor([longest - len(p) for p in PROMPTS])
            tokens = torch.tensor([[0] * (longest - len(p)) + p for p in PROMPTS])
            cache = decoder.init_cache(len(PROMPTS), longest + 2)
            with torch.no_grad():
                logits, cache = decoder.forward(tokens, cache, 0, pad, longest + 2)
                full = init_params(run.model.param_specs(cfg.model), seed=cfg.train.seed)
                one_device = LocalDecoder(run.model, full, cfg.model)
                one, _ = one_device.forward(tokens, one_device.init_cache(len(PROMPTS), longest + 2), 0, pad,
                                            longest + 2)
            result["cache_local"] = [(tuple(k.to_local().shape), tuple(v.to_local().shape)) for k, v in cache.values()]
            result["cache_global"] = tuple(cache[0][0].shape)
            result["logits_shape"] = tuple(logits.shape)
            result["logits_gap"] = float((logits[..., :cfg.model.vocab_size] - one).abs().max())
        out[name] = result
    return out


@pytest.mark.slow
def test_mesh_generation_equals_one_device_and_ranks_agree():
    ranks = run_ranks(2, "tests.test_generate_tp:on_ranks")
    for name in CASES:
        cfg = config(name).model
        first, second = ranks[0][name], ranks[1][name]
        assert first["greedy"] == second["greedy"], name
        assert first["sampled"] == second["sampled"], name
        assert first["stopped"] == second["stopped"], name
        expected = single_device(name)
        assert first["greedy"] == expected, name
        assert first["stopped"] == single_device(name, stop_tokens=[expected[0][3]]), name
        assert len(first["stopped"][0]) == 3
        # the logits differ from one device's by float rounding only (~1e-5), far too little to
        # move a draw of the same seeded generator across a token boundary
        assert first["sampled"] == single_device(name, temperature=1.0, top_p=0.9, seed=3), name
        assert len({tuple(row) for row in expected}) == len(PROMPTS)  # varied: not trivially equal
        if "pp2" in name:  # each rank caches only its stages' blocks; together, all of them
            blocks = [first["cached_blocks"], second["cached_blocks"]]
            assert sorted(blocks[0] + blocks[1]) == list(range(cfg.n_layers)) and not set(blocks[0]) & set(blocks[1])
            continue
        if name.endswith("dp2"):
            continue
        heads = getattr(cfg, "kv_heads", cfg.n_heads)
        longest = max(map(len, PROMPTS))
        local = (len(PROMPTS), longest + 2, heads // 2, cfg.head_dim)
        for rank in (first, second):
            assert rank["cache_local"] == [(local, local)] * cfg.n_layers, name
            assert rank["cache_global"] == (len(PROMPTS), longest + 2, heads, cfg.head_dim)
            assert rank["logits_shape"] == (len(PROMPTS), longest, 256)  # padded 255 -> 256 under tp
            assert rank["logits_gap"] < 1e-4, (name, rank["logits_gap"])


def test_without_parallel_it_is_generate_cached(tiny_llama):
    cfg = override(tiny_llama, ["train.compile=false", "train.device=cpu", "model.init_std=0.3"])
    run = Run(cfg)
    assert generate_on_mesh(run, PROMPTS, NEW) == generate_cached(run.model, run.params, cfg.model, PROMPTS, NEW)


@pytest.mark.slow
def test_tp_next_to_zero3_and_pp_next_to_tp():
    ranks = run_ranks(4, "tests.test_generate_tp:on_four_ranks")
    for name in FOUR_RANKS:
        assert [rank[name] for rank in ranks] == [single_device(name)] * 4, name
