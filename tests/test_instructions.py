"""Instruction tuning data: the chat template, the loss on the assistant's tokens only (a
gradient check: the loss does not depend on the logits at any other position), every row
format with clear errors, and SFT through the same Run."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from fxmega.config import load, override
from fxmega.core import tree
from fxmega.core.errors import ConfigError, DataError
from fxmega.data.instructions import END, InstructionBatches, pack, prompt_text, read_conversations, render, sft_batch
from fxmega.data.tokenizer import ByteTokenizer
from fxmega.models import lm_loss_sum, model_for
from fxmega.ops import objectives
from fxmega.ops.init import init_params
from fxmega.training.run import Run
from tests.multirank import ROOT
from tests.tolerance import assert_within_rounding

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"}]


def test_template_marks_only_the_assistants_tokens():
    tok = ByteTokenizer()
    ids, mine = render(CHAT, tok)
    text = tok.decode(ids)
    assert text == ("<|system|>\nBe brief.<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n"
                    "<|user|>\nand 3+3?<|end|>\n<|assistant|>\n6<|end|>\n")
    assert tok.decode([i for i, m in zip(ids, mine) if m]) == f"4{END}6{END}"
    # what generation continues is the template's own prefix
    assert text.startswith(prompt_text(CHAT[:4]))  # through the second question


def test_prompt_tokens_carry_no_loss():
    """The objective's gradient with respect to the logits is zero at every position whose
    target is not the assistant's, and not zero at those that are."""
    tok = ByteTokenizer()
    batch = sft_batch([[render(CHAT, tok)], [render(CHAT[1:3], tok)]], seq_len=128)
    logits = torch.randn(2, 128, 256, dtype=torch.float64, requires_grad=True)
    loss, count = objectives.causal_lm(256)(logits, batch)
    loss.backward()
    touched = logits.grad.abs().sum(-1) > 0
    assert torch.equal(touched, batch["loss_mask"].bool())
    assert count == batch["loss_mask"].sum() == 2 * len("4<|end|>") + len("6<|end|>")
    assert batch["attention_mask"][1].sum() < 128  # the short one is right-padded


def _conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Conversations of varied lengths: a question of 1-12 words, its words reversed."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = list(rng.choice("red blue green cat dog".split(), int(rng.integers(1, 13))))
        out.append([{"role": "user", "content": " ".join(words)},
                    {"role": "assistant", "content": " ".join(reversed(words))}])
    return out


def test_packing_puts_every_sample_in_one_row_within_the_length():
    tok = ByteTokenizer()
    samples = [render(c, tok) for c in _conversations(40)]
    seq_len = 256
    groups = pack(samples, seq_len)
    assert sorted(i for g in groups for i in g) == list(range(40))
    assert all(sum(len(samples[i][0]) - 1 for i in g) <= seq_len for g in groups)
    assert len(groups) < 40 / 2  # the samples are 45-151 tokens, 104 on average
    batch = sft_batch([[samples[i] for i in g] for g in groups], seq_len, packed=True)
    for r, g in enumerate(groups):  # each document in turn, its positions from 0, then padding (0)
        lengths = [len(samples[i][0]) - 1 for i in g]
        docs = [d for d, n in enumerate(lengths, 1) for _ in range(n)]
        docs += [0] * (seq_len - len(docs))
        assert batch["attention_mask"][r].tolist() == docs
        assert batch["positions"][r].tolist()[:sum(lengths)] == [p for n in lengths for p in range(n)]
    assert batch["loss_mask"].sum() == sum(sum(own[1:]) for _, own in samples)
    data = InstructionBatches(samples, seq_len, seed=0, split="train", packed=True)
    assert len(data.rows) == len(groups)


@pytest.mark.parametrize("config", ["tiny_gpt.py", "tiny_llama.py"])
def test_packed_batches_equal_unpacked(config):
    """The same conversations one per row and packed several per row give the same summed
    loss, count and gradients: attention stays inside each conversation (block-diagonal
    causal mask) and positions restart in each (learned positions for GPT, rotary for Llama)."""
    seq_len = 128  # the samples are 55-153 tokens: the longest are cut, alike both ways
    cfg = dataclasses.replace(load(ROOT / "configs" / config).model, max_seq_len=seq_len)
    model = model_for(cfg)
    params = init_params(model.param_specs(cfg), 0, dtype=torch.float64)
    tok = ByteTokenizer()
    samples = [render(c, tok) for c in _conversations(12, seed=1)]
    unpacked = sft_batch([[s] for s in samples], seq_len)
    packed = sft_batch([[samples[i] for i in g] for g in pack(samples, seq_len)], seq_len, packed=True)
    assert packed["inputs"].shape[0] < unpacked["inputs"].shape[0]
    results = []
    for batch in (unpacked, packed):
        trainable = tree.map_leaves(lambda p: p.detach().requires_grad_(), params)
        loss = lm_loss_sum(trainable, batch, cfg)
        grads = torch.autograd.grad(loss, tree.leaves(trainable))
        results.append((loss, objectives.count(batch), grads))
    (loss_u, count_u, grads_u), (loss_p, count_p, grads_p) = results
    assert count_u == count_p
    # float64 parameters, but the cross-entropy runs in fp32 by design: the two differ in the
    # order of the fp32 softmax over the vocabulary and of the fp32 sum over the batch's tokens
    # (positive terms: relative to the loss), and the float64 model's summation orders
    loss_lengths = cfg.vocab_size + int(count_u)
    assert_within_rounding(loss_p, loss_u, loss_lengths, scale=float(loss_u.detach()), what="summed loss")
    lengths = (cfg.n_layers * (cfg.d_model + (getattr(cfg, "d_ff", 0) or 4 * cfg.d_model) + seq_len),
               cfg.vocab_size + int(count_u))
    for g_p, g_u in zip(grads_p, grads_u):
        assert_within_rounding(g_p, g_u, lengths, what="gradient")


def test_row_formats_and_errors(tmp_path):
    rows = [{"messages": CHAT}, {"prompt": "hi", "response": "hello"}, {"src": "cat", "tgt": "chat"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    chats = read_conversations(tmp_path / "c.jsonl")
    assert chats[1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert chats[2][1]["content"] == "chat"
    for bad, match in (({"text": "x"}, "expected"), ({"messages": [{"role": "bot", "content": "x"}]}, "role"),
                       ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message")):
        (tmp_path / "b.jsonl").write_text(json.dumps(bad))
        with pytest.raises(DataError, match=match):
            read_conversations(tmp_path / "b.jsonl")


@pytest.mark.parametrize("packed", [False, True])
def test_sft_through_the_run(tmp_path, packed):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(120):  # answer with the question's words reversed
        words = list(rng.choice("red blue green cat dog".split(), 3))
        rows.append({"prompt": " ".join(words), "response": " ".join(reversed(words))})
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["data.task=sft", f"data.source={tmp_path / 'chat.jsonl'}", "train.compile=false",
                    "train.device=cpu", "train.seq_len=48", "train.steps=30", f"data.pack={packed}"])
    run = Run(cfg)
    assert ("packed" in run.data.description) == packed
    losses = [run.do_step()["loss"] for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    with pytest.raises(ConfigError, match="data.task=sft trains a decoder-only model"):
        Run(override(load(ROOT / "configs" / "tiny_t5.py"), ["data.task=sft", f"data.source={tmp_path}"]))
    with pytest.raises(ConfigError, match="does not take a position per token"):
        Run(override(load(ROOT / "configs" / "tiny_bert.py"), ["data.task=sft", "data.pack=true",
                                                               f"data.source={tmp_path / 'chat.jsonl'}"]))
    with pytest.raises(ConfigError, match="data.pack=true packs conversations"):
        override(cfg, ["data.task=pretrain", "data.pack=true"]).validate()
