"""Every weight matmul of every family goes through ``ops.matmul`` (the hook an fp8 recipe
replaces): with a recipe that tags what it computes, a forward of each family runs no
matrix product outside it, and the roles it sees are the family's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxmega.config import load, override
from fxmega.models import lm_loss_sum, model_for
from fxmega.models.t5 import example_batch
from fxmega.ops import matmul as matmul_hook
from fxmega.ops.init import init_params
from tests.conftest import ROOT

PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "_grouped_mm", "matmul", "dot", "mv"}


class Products(TorchDispatchMode):
    """Counts the aten matrix products that run, apart from those inside a recipe call."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.outside: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRODUCTS and not self.inside:
            self.outside[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_llama", "tiny_moe", "tiny_bert", "tiny_t5"])
def test_every_weight_matmul_goes_through_the_hook(name):
    cfg = override(load(ROOT / "configs" / f"{name}.py"), ["train.seq_len=16"])
    mcfg, model = cfg.model, model_for(cfg.model)
    params = init_params(model.param_specs(mcfg), 0)
    if model.example_batch is not None:
        batch = example_batch(mcfg, 2, "cpu")
    else:
        tokens = torch.randint(0, mcfg.vocab_size, (2, 17))
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    products, roles = Products(), Counter()

    def tagged(x: torch.Tensor, w: torch.Tensor, role: str) -> torch.Tensor:
        roles[role] += 1
        products.inside += 1
        try:
            return torch.matmul(x, w)
        finally:
            products.inside -= 1

    with matmul_hook.use(matmul_hook.MatmulRecipe("tagged", tagged)), torch.no_grad(), products:
        loss = lm_loss_sum(params, batch, mcfg)
    assert torch.isfinite(loss)
    assert not products.outside, f"{name}: matrix products outside ops.matmul: {dict(products.outside)}"
    assert roles["linear"] >= 2 * mcfg.n_layers, roles  # at least q/k/v/o and the MLP per block
    assert roles["head"] == 1, roles  # the output head, which an fp8 recipe keeps in the compute precision
    assert set(roles) <= set(matmul_hook.ROLES)
    if name == "tiny_moe":
        assert roles["router"] and roles["expert"], roles
