"""The parameters-only loader (``fxmega.inference.model_loader``): what inference builds from a
checkpoint is the parameters and nothing else — no optimizer moments, no data, no step."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxmega.config import load, override
from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.inference.model_loader import init_model, load_model
from fxmega.ops.init import init_params
from fxmega.training.run import Run
from tests.conftest import ROOT

FACTORIES = {"empty", "empty_strided", "zeros", "ones", "full", "rand", "randn", "normal", "zeros_like", "empty_like",
             "ones_like", "clone", "new_empty", "new_zeros", "arange"}


class Allocations(TorchDispatchMode):
    """Bytes of every tensor a factory op (or a clone) creates, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self._made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in FACTORIES and isinstance(out, torch.Tensor):
            self.bytes[name] = self.bytes.get(name, 0) + out.numel() * out.element_size()
            self._made.append(weakref.ref(out))
        return out

    def live_bytes(self) -> int:
        """Bytes of the tensors made that are still alive (an init's temporaries are not)."""
        return sum(t.numel() * t.element_size() for t in (ref() for ref in self._made) if t is not None)


def _cfg(*extra: str):
    return override(load(ROOT / "configs" / "tiny_gpt.py"), ["data.source=mock", "train.compile=false", *extra])


def test_loading_allocates_the_parameters_and_nothing_else(tmp_path, monkeypatch):
    cfg = _cfg()
    run = Run(cfg)
    run.step = 3
    run.save(str(tmp_path))
    param_bytes = sum(t.numel() * t.element_size() for t in tree.leaves(run.params))

    # no data source may be touched: every builder of batches fails loudly here
    import fxmega.data.sources as sources
    monkeypatch.setattr(sources, "_token_data", lambda *a: pytest.fail("the loader built a data pipeline"))
    with Allocations() as seen:
        loaded = load_model(cfg, path=str(tmp_path), with_tokenizer=False)
    assert sum(seen.bytes.values()) == param_bytes, seen.bytes  # not 3x (AdamW's two moments), not more
    assert not hasattr(loaded, "opt_state") and not hasattr(loaded, "train_step") and not hasattr(loaded, "data")
    for path, want in tree.items(run.params):
        got = dict(tree.items(loaded.params))[path]
        assert torch.equal(got, want.detach()), path  # bitwise: read back, not re-initialised
        assert not got.requires_grad


def test_loading_names_the_missing_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=r"eval needs a checkpoint: --load CKPT"):
        load_model(_cfg(), command="eval")
    with pytest.raises(ConfigError, match=f"--load {tmp_path}: no checkpoint there"):
        load_model(_cfg(), path=str(tmp_path))


def test_a_tokenizer_smaller_than_the_vocabulary_is_the_only_refusal_of_a_wider_model(tmp_path):
    """A byte tokenizer for a 256-id model loads; a model whose vocabulary is narrower than
    its tokenizer's cannot have been trained with it."""
    cfg = _cfg()
    Run(cfg).save(str(tmp_path))
    assert load_model(cfg, path=str(tmp_path)).tokenizer.vocab_size == 256
    narrow = _cfg("model.vocab_size=200")
    with pytest.raises(ConfigError, match=r"model.vocab_size=200 is smaller than the byte tokenizer's 256"):
        load_model(narrow, path=str(tmp_path))


def test_a_model_from_init_is_the_seeded_init_and_nothing_else():
    cfg = _cfg()
    with Allocations() as seen:
        model = init_model(cfg)
    want = init_params(model.specs, cfg.train.seed)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(model.params), tree.leaves(want)))
    param_bytes = sum(t.numel() * t.element_size() for t in tree.leaves(want))
    # what the init leaves is the parameters, nothing for an optimizer (drawing by position makes
    # temporaries per block of values; they are gone once a tensor is drawn)
    assert seen.live_bytes() == param_bytes, seen.bytes
    assert model.tokenizer is None and not hasattr(model, "opt_state")
