"""Generation with a KV cache: token for token and logit for logit what recomputing the whole
sequence gives, for GPT, Llama (grouped, multi-query and plain multi-head attention) and
DeepSeek-V3 (latent attention over its latent cache),
batched prompts of different lengths as each alone, and the sampling settings."""

import dataclasses
from functools import partial

import pytest
import torch

from fxmega.config import load
from fxmega.data.tokenizer import ByteTokenizer
from fxmega.inference.generate import (
    LocalDecoder,
    check_sampling,
    decode,
    generate_cached,
    sample_next,
    sample_text,
)
from fxmega.models import deepseek_v3, gpt, llama
from fxmega.ops.init import init_params
from tests.conftest import ROOT
from tests.tolerance import assert_within_rounding, forward_lengths

# a larger init than training's 0.02, so that greedy decoding of an untrained model does not
# just repeat one token and the comparisons below see varied sequences
VARIANTS = {
    "gpt": (gpt, "tiny_gpt.py", {}),
    "llama_gqa": (llama, "tiny_llama.py", {"n_kv_heads": 2}),  # 4 query heads share 2 kv heads
    "llama_mqa": (llama, "tiny_llama.py", {"n_kv_heads": 1}),
    "llama_mha": (llama, "tiny_llama.py", {"n_kv_heads": 0}),
    # multi-head latent attention over its latent cache (queries absorbed into the latent space)
    "deepseek_v3": (deepseek_v3, "tiny_deepseek_v3.py", {}),
}
PROMPTS = [[5, 17, 99, 3, 42, 42, 7, 200, 11], [65], [1, 2, 3, 4]]


@pytest.fixture(scope="module", params=list(VARIANTS))
def lm(request):
    module, config, overrides = VARIANTS[request.param]
    cfg = dataclasses.replace(load(ROOT / "configs" / config).model, init_std=0.3, **overrides)
    cfg.validate()
    return module, init_params(module.param_specs(cfg), seed=0), cfg


def prefill(module, params, cfg, tokens, max_len, pad=None, cache=None):
    """The decoder's forward over ``tokens`` from slot 0 of a fresh (or the given) cache."""
    dec = LocalDecoder(module.FAMILY, params, cfg)
    pad = torch.zeros(tokens.shape[0], dtype=torch.long) if pad is None else pad
    return dec.forward(tokens, dec.init_cache(tokens.shape[0], max_len) if cache is None else cache, 0, pad, max_len)


def greedy_without_cache(module, params, cfg, prompt, n):
    tokens = torch.tensor([prompt])
    for _ in range(n):
        nxt = module.forward(params, tokens, cfg)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[0, len(prompt):].tolist()


def test_cached_greedy_equals_recomputing_the_sequence(lm):
    module, params, cfg = lm
    for prompt in PROMPTS:
        assert generate_cached(module.FAMILY, params, cfg, [prompt], 12) == [greedy_without_cache(module, params, cfg,
                                                                                            prompt, 12)]


def test_cached_logits_equal_the_uncached_forward_at_every_step(lm):
    module, _, cfg = lm
    cfg = dataclasses.replace(cfg, init_std=0.02)  # training's init: logits of order 1
    params = init_params(module.param_specs(cfg), seed=0)
    tokens = torch.tensor([PROMPTS[0]])
    dec, total, pad = LocalDecoder(module.FAMILY, params, cfg), tokens.shape[1] + 8, torch.zeros(1, dtype=torch.long)
    logits, cache = dec.forward(tokens, dec.init_cache(1, total), 0, pad, total)
    # the cache's attention sums over its own length in another order than the forward's
    n = forward_lengths(cfg, tokens.shape[1] + 8)
    assert_within_rounding(logits, module.forward(params, tokens, cfg), n, what="prefill")
    for _ in range(8):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        start = tokens.shape[1]
        tokens = torch.cat([tokens, nxt], dim=1)
        logits, cache = dec.forward(nxt, cache, start, pad, total)
        assert logits.shape == (1, 1, cfg.vocab_size)
        assert_within_rounding(logits[:, -1], module.forward(params, tokens, cfg)[:, -1], n, what="decode")


def test_batched_prompts_of_different_lengths_equal_each_alone(lm):
    module, params, cfg = lm
    batched = generate_cached(module.FAMILY, params, cfg, PROMPTS, 10)
    assert batched == [generate_cached(module.FAMILY, params, cfg, [p], 10)[0] for p in PROMPTS]
    assert len({tuple(row) for row in batched}) == len(PROMPTS)  # not trivially equal

    # and the left-padded prefill's last logits per row equal each prompt's own forward
    longest = max(map(len, PROMPTS))
    pad = torch.tensor([longest - len(p) for p in PROMPTS])
    tokens = torch.tensor([[0] * (longest - len(p)) + p for p in PROMPTS])
    logits, _ = prefill(module, params, cfg, tokens, longest + 1, pad)
    for row, prompt in enumerate(PROMPTS):
        expected = module.forward(params, torch.tensor([prompt]), cfg)[0, -1]
        assert_within_rounding(logits[row, -1], expected, forward_lengths(cfg, longest + 1), what=f"row {row}")


def test_unwritten_cache_slots_are_never_read_and_the_cache_is_not_modified(lm):
    module, params, cfg = lm
    tokens = torch.tensor([PROMPTS[2]])
    clean = LocalDecoder(module.FAMILY, params, cfg).init_cache(1, 16)
    junk = {i: (torch.randn_like(k) * 100, torch.randn_like(v) * 100) for i, (k, v) in clean.items()}
    before = [(k.clone(), v.clone()) for k, v in junk.values()]
    from_clean, _ = prefill(module, params, cfg, tokens, 16, cache=clean)
    from_junk, written = prefill(module, params, cfg, tokens, 16, cache=junk)
    torch.testing.assert_close(from_junk, from_clean, atol=0, rtol=0)  # masked slots weigh exactly 0
    for (k, v), (k0, v0) in zip(junk.values(), before):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # functional: a new cache is returned
    assert not torch.equal(written[0][0][:, :4], junk[0][0][:, :4])


def test_top_k_one_and_a_tiny_top_p_are_greedy(lm):
    module, params, cfg = lm
    greedy = generate_cached(module.FAMILY, params, cfg, PROMPTS, 8)
    assert generate_cached(module.FAMILY, params, cfg, PROMPTS, 8, temperature=1.0, top_k=1, seed=3) == greedy
    assert generate_cached(module.FAMILY, params, cfg, PROMPTS, 8, temperature=1.0, top_p=1e-6, seed=3) == greedy


def test_sampling_is_reproducible_with_a_seed_and_differs_across_seeds(lm):
    module, params, cfg = lm
    run = lambda seed: generate_cached(module.FAMILY, params, cfg, PROMPTS, 12, temperature=1.0, top_p=0.95, seed=seed)
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_a_row_samples_the_same_whichever_rows_share_its_batch(lm):
    """Each row draws from its own generator (seed, row index): a share of a request, decoded
    apart as a data-parallel rank decodes it, samples what the whole request samples."""
    module, params, cfg = lm
    kwargs = dict(temperature=1.0, top_p=0.95, seed=5)
    whole = generate_cached(module.FAMILY, params, cfg, PROMPTS, 12, **kwargs)
    dec = LocalDecoder(module.FAMILY, params, cfg)
    assert decode(dec, cfg, [PROMPTS[2], PROMPTS[0]], 12, rows=[2, 0], **kwargs) == [whole[2], whole[0]]
    assert decode(dec, cfg, [PROMPTS[1]], 12, rows=[1], **kwargs) == [whole[1]]


def test_stop_tokens_end_each_sequence_and_stopped_rows_are_not_extended(lm):
    module, params, cfg = lm
    free = generate_cached(module.FAMILY, params, cfg, PROMPTS, 10)
    stop = free[0][3]
    stopped = generate_cached(module.FAMILY, params, cfg, PROMPTS, 10, stop_tokens=[stop])
    for row, out in zip(free, stopped):
        expected = row[:row.index(stop)] if stop in row else row
        assert out == expected  # the stop token itself is not returned
    assert len(stopped[0]) == free[0].index(stop) < 10


def test_generation_ends_once_every_row_has_stopped(lm):
    module, params, cfg = lm
    calls = []

    class Counting(LocalDecoder):
        def forward(self, tokens, *args, **kwargs):
            calls.append(tokens.shape[1])
            return super().forward(tokens, *args, **kwargs)

    first = generate_cached(module.FAMILY, params, cfg, [PROMPTS[0]], 1)[0][0]
    assert decode(Counting(module.FAMILY, params, cfg), cfg, [PROMPTS[0]], 20, stop_tokens=[first]) == [[]]
    assert calls == [len(PROMPTS[0])]  # the prefill only: no decode step after the stop


def test_a_request_longer_than_max_seq_len_raises_naming_the_numbers(tiny_gpt):
    cfg = tiny_gpt.model
    params = init_params(gpt.param_specs(cfg), seed=0)
    with pytest.raises(ValueError, match=r"prompt 1 has 60 tokens and max_new_tokens=5: .*65 exceeds "
                                         r"max_seq_len=64.*at most 59 tokens.*at most 4"):
        generate_cached(gpt.FAMILY, params, cfg, [[1], [2] * 60], 5)
    generate_cached(gpt.FAMILY, params, cfg, [[2] * 59], 5)  # exactly fits
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate_cached(gpt.FAMILY, params, cfg, [[]], 5)
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        generate_cached(gpt.FAMILY, params, cfg, [[1]], 5, top_p=0)
    with pytest.raises(ValueError, match=r"token ids \[256\] outside the vocabulary \[0, 256\)"):
        generate_cached(gpt.FAMILY, params, cfg, [[1, 256]], 5)


def test_sample_text_is_run_sample_on_the_cache_in_windows(tiny_llama):
    cfg = tiny_llama.model
    params = init_params(llama.param_specs(cfg), seed=0)
    tok = ByteTokenizer()
    gen = partial(generate_cached, llama.FAMILY, params, cfg)
    new = gen([tok.encode("Hi")], 5, temperature=0.8, top_k=40, seed=7)[0]
    assert sample_text(gen, cfg, tok, "Hi", 5, seed=7) == tok.decode(tok.encode("Hi") + new)
    # a prompt too long for the window conditions on its last max_seq_len - max_new_tokens tokens
    long_prompt = "x" * 50 + "y" * 50
    new = gen([tok.encode(long_prompt)[-(64 - 8):]], 8, temperature=0)[0]
    assert sample_text(gen, cfg, tok, long_prompt, 8, temperature=0) == tok.decode(tok.encode(long_prompt) + new)
    # longer than the context: windows that keep the last half and add the other half
    calls = []

    def recording(prompts, n, **kwargs):
        calls.append((len(prompts[0]), n, kwargs["seed"]))
        return gen(prompts, n, **kwargs)

    sample_text(recording, cfg, tok, "Hi", 100, temperature=0, seed=7)
    # (context tokens, new tokens, seed) per window: 2 + 32, then the last 32 + 32 twice, then 60 + 4
    assert calls == [(2, 32, 7), (32, 32, 8), (32, 32, 9), (60, 4, 10)]


@pytest.mark.parametrize("temperature,top_p", [(1e-39, 1.0), (1e-40, 0.9), (1.0, 1e-46), (5e-324, 1e-46)])
def test_edge_sampling_values_sample_the_most_likely_token_not_nan(temperature, top_p):
    """A temperature so small that logits / temperature overflows, or a top_p that rounds to 0
    in fp32, is greedy in the limit: the most likely token, never a NaN probability (before,
    HTTP 500 "probability tensor contains inf/nan" and a traceback from run.py generate)."""
    logits = torch.tensor([[2.0, 3.0, -1.0, 0.5], [7.0, -2.0, 6.5, 7.5]])
    got = sample_next(logits, temperature, 0, torch.Generator().manual_seed(0), top_p=top_p)
    assert got.tolist() == [1, 3]


def test_a_temperature_that_is_not_a_finite_number_is_refused():
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature=.* must be 0 \\(greedy\\) or a finite positive number"):
            check_sampling(4, bad, 0, 1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    seen = lambda p: set(sample_next(logits, 1.0, 0, torch.Generator().manual_seed(0), top_p=p).tolist())
    assert seen(0.45) == {0}
    assert seen(0.75) == {0, 1}
    assert seen(0.85) == {0, 1, 2}
    assert seen(1.0) == {0, 1, 2, 3}
    # top-k applies first: of the two most likely, the nucleus of 0.9 is both
    assert set(sample_next(logits, 1.0, 2, torch.Generator().manual_seed(0), top_p=0.9).tolist()) == {0, 1}
