"""The tied embedding's gradient pass (fxmega.ops.tied_embedding_grad): the lookup's rows
are scatter-added into the head's product instead of into a zero-filled table, and the
gradient is the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxmega.ops import tied_embedding_grad
from fxmega.ops.tied_embedding_grad import TiedEmbeddingGradient
from fxmega.training import step
from fxmega.training.run import Run

VOCAB, D, TOKENS = 50, 16, 24


def _tied_loss(w: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    h = torch.tanh(F.embedding(tokens, w, padding_idx=padding_idx))
    return F.cross_entropy(h @ w.t(), targets)


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_gradient_is_summed_in_the_products_buffer_and_equal(padding_idx: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, D, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    tokens[:4] = 3  # some rows of the padding index, which must add nothing from the lookup
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)

    reference = w.clone().requires_grad_(True)
    _tied_loss(reference, tokens, targets, padding_idx).backward()

    torch._dynamo.reset()
    tied = TiedEmbeddingGradient()
    loss_fn = torch.compile(_tied_loss, backend="inductor", fullgraph=True,
                            options={"post_grad_custom_pre_pass": tied, "fx_graph_cache": False})
    got = w.float().requires_grad_(True)
    loss_fn(got, tokens, targets, padding_idx).backward()

    assert tied.rewrites == 1  # the backward's one sum of the head's and the lookup's gradients
    # each entry sums at most TOKENS products of length D in fp32 (the reference is float64)
    tol = TOKENS * D * torch.finfo(torch.float32).eps * reference.grad.abs().max().item()
    torch.testing.assert_close(got.grad.double(), reference.grad, rtol=0, atol=tol)


def test_untied_gradients_are_left_alone() -> None:
    """A head with its own weight: no sum to rewrite."""
    torch._dynamo.reset()
    tied = TiedEmbeddingGradient()

    def untied(table: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return (F.embedding(tokens, table) @ head).logsumexp(-1).sum()

    fn = torch.compile(untied, backend="inductor", fullgraph=True,
                       options={"post_grad_custom_pre_pass": tied, "fx_graph_cache": False})
    table, head = torch.randn(VOCAB, D, requires_grad=True), torch.randn(D, VOCAB, requires_grad=True)
    fn(table, head, torch.arange(TOKENS) % VOCAB).backward()
    assert tied.rewrites == 0


def test_every_inductor_step_runs_the_pass(tiny_gpt, monkeypatch) -> None:
    """The train step's graphs are compiled with the pass (recorded, not compiled)."""
    seen: list[dict | None] = []
    monkeypatch.setattr(step, "compiled", lambda fn, backend="inductor", options=None: seen.append(options) or fn)
    Run(tiny_gpt)
    train_graphs = seen[:2]  # the accumulate and update graphs (the eval step after them has no backward)
    assert len(seen) == 3 and all(o["post_grad_custom_pre_pass"] is tied_embedding_grad.TIED_EMBEDDING_GRADIENT
                                  for o in train_graphs)
    assert isinstance(tied_embedding_grad.TIED_EMBEDDING_GRADIENT.uuid(), (bytes, str))  # its FX-cache key
