"""Turn a tree of ParamSpecs into tensors, deterministically.

Every parameter draws from its own generator seeded by (global seed, parameter path), so a
parameter's values do not depend on which other parameters exist, on the order they are
built in, or on the device or mesh that later holds them: a sharded rank builds the full
tensor from the same seed and keeps its slice (``fxmega.sharding`` does that), and gets
exactly the values a single device has.
"""

from __future__ import annotations

import hashlib

import torch

from fxmega.core import tree
from fxmega.core.spec import ParamSpec


def param_seed(seed: int, path: str) -> int:
    """A 63-bit seed for one parameter, stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(spec: ParamSpec, path: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full, unsharded initial value of one parameter, built on the CPU.

    Drawn on the CPU in fp32 whatever the target device, because CPU generators give the
    same numbers everywhere while CUDA generators need not.
    """
    if spec.init.kind == "zeros":
        out = torch.zeros(spec.shape)
    elif spec.init.kind == "ones":
        out = torch.ones(spec.shape)
    else:
        gen = torch.Generator().manual_seed(param_seed(seed, path))
        out = torch.randn(spec.shape, generator=gen) * spec.init.std
    return out.to(dtype)


def init_params(specs: tree.Tree, seed: int, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> tree.Tree:
    """Materialise every parameter, unsharded, on one device."""
    return tree.map_with_path(lambda path, spec: init_tensor(spec, path, seed, dtype).to(device), specs)


def meta_params(specs: tree.Tree, dtype: torch.dtype = torch.float32) -> tree.Tree:
    """Parameters on the meta device: shapes and dtypes only, no memory."""
    return tree.map_leaves(lambda spec: torch.empty(spec.shape, dtype=dtype, device="meta"), specs)


def count_params(specs: tree.Tree) -> int:
    """Number of scalars in a spec tree, from shapes alone."""
    return sum(spec.numel for spec in tree.leaves(specs))
