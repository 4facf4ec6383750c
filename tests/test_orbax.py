"""orbax interop (runs where the `orbax` extra is installed; `make` installs it with dev):
fxmega checkpoint -> orbax pytree -> fxmega checkpoint gives the same parameters, and JAX
reads the arrays."""

import json

import numpy as np
import pytest
import torch

from fxmega.cli import main
from fxmega.config import load, override
from fxmega.core import tree
from fxmega.core.errors import CheckpointError
from fxmega.storage.orbax_io import from_orbax
from fxmega.training.run import Run
from tests.conftest import ROOT

ocp = pytest.importorskip("orbax.checkpoint")


def test_round_trip_through_orbax(tmp_path, capsys):
    cfg = override(load(ROOT / "configs" / "tiny_llama.py"), ["train.compile=false"])
    run = Run(cfg)
    run.do_step()
    run.save(str(tmp_path / "ckpt"))
    common = ["--config", str(ROOT / "configs" / "tiny_llama.py")]
    assert main(["convert", *common, "--load", str(tmp_path / "ckpt"), "--to-orbax", str(tmp_path / "orbax")]) == 0
    meta = json.loads((tmp_path / "orbax" / "fxmega_model.json").read_text())
    assert meta["family"] == "llama"
    import jax.numpy as jnp

    arrays = ocp.StandardCheckpointer().restore(tmp_path / "orbax" / "params")
    head = jnp.asarray(dict(tree.items(arrays))["head"])  # the JAX side reads it as it is
    assert np.array_equal(np.asarray(head), run.params["head"].detach().numpy())
    assert main(["convert", "--from-orbax", str(tmp_path / "orbax"), "--save", str(tmp_path / "back")]) == 0
    back = Run(cfg)
    assert back.resume(str(tmp_path / "back"))
    for a, b in zip(tree.leaves(back.params), tree.leaves(run.params)):
        assert torch.equal(a, b)


def test_orbax_without_model_description_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="fxmega_model.json does not exist; export it with run.py convert "
                                              "--to-orbax"):
        from_orbax(tmp_path)
