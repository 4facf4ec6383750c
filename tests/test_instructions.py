"""Instruction tuning data: the chat template, the loss on the assistant's tokens only (a
gradient check: the loss does not depend on the logits at any other position), every row
format with clear errors, and SFT through the same Run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fxmega.config import load, override
from fxmega.core.errors import ConfigError, DataError
from fxmega.data.instructions import END, prompt_text, read_conversations, render, sft_batch
from fxmega.data.tokenizer import ByteTokenizer
from fxmega.ops import objectives
from fxmega.training.run import Run
from tests.multirank import ROOT

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
    batch = sft_batch([render(CHAT, tok), render(CHAT[1:3], tok)], seq_len=128)
    logits = torch.randn(2, 128, 256, dtype=torch.float64, requires_grad=True)
    loss, count = objectives.causal_lm(256)(logits, batch)
    loss.backward()
    touched = logits.grad.abs().sum(-1) > 0
    assert torch.equal(touched, batch["loss_mask"].bool())
    assert count == batch["loss_mask"].sum() == 2 * len("4<|end|>") + len("6<|end|>")
    assert batch["attention_mask"][1].sum() < 128  # the short one is right-padded


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


def test_sft_through_the_run(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(120):  # answer with the question's words reversed
        words = list(rng.choice("red blue green cat dog".split(), 3))
        rows.append({"prompt": " ".join(words), "response": " ".join(reversed(words))})
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["data.task=sft", f"data.source={tmp_path / 'chat.jsonl'}", "train.compile=false",
                    "train.device=cpu", "train.seq_len=48", "train.steps=30"])
    run = Run(cfg)
    losses = [run.do_step()["loss"] for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    with pytest.raises(ConfigError, match="data.task=sft trains a decoder-only model"):
        Run(override(load(ROOT / "configs" / "tiny_t5.py"), ["data.task=sft", f"data.source={tmp_path}"]))
