"""fp8 training matmuls through torchao: the precision recipes ``compute.fp8`` names.

A recipe is a ``MatmulRecipe`` (``fxmega.ops.matmul``): each weight matmul the filter
accepts runs as torchao's ``matmul_with_hp_or_float8_args`` — an autograd function over
plain tensors, the one ``torchao.float8``'s ``Float8Linear`` calls — which casts both
operands to fp8 with dynamic scales, multiplies, and in the backward casts the output
gradient and the operands again for the two gradient matmuls:

- ``tensorwise``: one scale per tensor (amax over all of it); inputs and weights in e4m3,
  gradients in e5m2 (torchao's default ``Float8LinearConfig``);
- ``rowwise``: one scale per row of each operand along the dim the matmul reduces, every
  cast in e4m3, scales rounded down to powers of two (torchao's ``rowwise``, torchtitan's
  default).

The **filter** keeps everything else in the compute precision, as torchtitan's does: only
``linear`` matmuls (the dense layers' projections) whose both dims are multiples of 16 (what
fp8 tensor-core GEMMs take); the router, the routed experts, the output head, attention's
products, norms and embeddings are untouched. Masters and optimizer state stay fp32.

On a GPU with fp8 tensor cores (compute capability 8.9 or newer) the casts feed
``torch._scaled_mm``. Elsewhere the recipe runs **emulated** (``Float8LinearConfig(emulate=
True)``): the same casts and scales, the matmul in fp32 on the dequantised values; that is
what proves the numerics on CPU, and the run's header says so.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from fxmega.core.errors import ConfigError
from fxmega.ops.matmul import PLAIN, MatmulRecipe, WeightUse, plain_matmul
from fxmega.sharding.mesh import MeshSpec

RECIPES = ("tensorwise", "rowwise")
# block-scaled formats need hardware this build has not been run on: refused with what they need
NEEDS_HARDWARE = {
    "mxfp8": "MX block scaling (32-element blocks, e8m0 scales) needs NVIDIA Blackwell (sm100) tensor cores",
    "nvfp4": "NVFP4 (fp4 e2m1 values with fp8 scales per 16 elements) needs NVIDIA Blackwell (sm100) tensor cores",
}
FP8_ROLES = ("linear",)
DIM_MULTIPLE = 16  # fp8 GEMMs (cuBLASLt's, torch._scaled_mm) need both dims of the weight in multiples of 16
# recipes whose weights ZeRO-3 / fsdp can gather in fp8 (``compute.fp8_gather``), and why not the others
GATHERED = ("tensorwise",)
NOT_GATHERED = {
    "rowwise": "rowwise casts each weight twice, scaled along each of its two dims (one cast per matmul that "
               "reads it), so a gather in fp8 would carry two fp8 copies: no fewer bytes than bf16 (torchao's "
               "and torchtitan's fp8 all-gather is tensorwise only for the same reason)",
}
E4M3 = torch.float8_e4m3fn  # tensorwise's weights (and inputs); gradients are e5m2
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with fp8 tensor cores
# mesh axes whose fp8 runs have not been shown equal to one device's yet: refused, with why
UNTESTED_AXES = {
    "cp": "context parallelism gives each rank part of every sequence, so the weight gradient's per-column "
          "scales (rowwise) and the activations' amax (tensorwise) would be taken over a rank's tokens only",
    "ep": "expert parallelism has not been run with fp8 dense layers yet (the routed experts stay in the "
          "compute precision either way)",
}


@dataclass(frozen=True)
class Fp8Filter:
    """Which weight matmuls run in fp8: those of ``roles`` whose weight's dims are both
    multiples of ``multiple``."""

    roles: tuple[str, ...] = FP8_ROLES
    multiple: int = DIM_MULTIPLE

    def accepts(self, w: torch.Tensor, role: str) -> bool:
        # under tp the GEMM each rank runs is on its slice of the weight: that is what must divide
        return self.accepts_shape(tuple(w.to_local().shape if isinstance(w, DTensor) else w.shape), role)

    def accepts_shape(self, shape: tuple[int, ...], role: str) -> bool:
        return role in self.roles and len(shape) == 2 and all(d % self.multiple == 0 for d in shape)

    def describe(self) -> str:
        return f"{'/'.join(self.roles)} matmuls with both dims multiples of {self.multiple}"


def check_recipe(name: str) -> None:
    """``compute.fp8`` is ``off`` or a recipe this build runs."""
    if name in NEEDS_HARDWARE:
        raise ConfigError(f"compute.fp8={name}: {NEEDS_HARDWARE[name]}, which this build has not been run on; "
                          f"use one of {', '.join(RECIPES)} (or off)")
    if name != "off" and name not in RECIPES:
        raise ConfigError(f"compute.fp8={name!r}: use one of off, {', '.join(RECIPES)}")


def check_mesh(name: str, mesh: MeshSpec) -> None:
    """fp8 on ``mesh``: refused on the axes where it has not been shown equal to one device."""
    for axis, why in UNTESTED_AXES.items():
        if mesh.size(axis) > 1:
            raise ConfigError(f"compute.fp8={name} with {axis}={mesh.size(axis)}: {why}; drop --fp8, or run "
                              f"without {axis}")


def check_gather(name: str) -> None:
    """``compute.fp8_gather`` with recipe ``name``: refused where the recipe's weights cannot be
    gathered as one fp8 copy."""
    if name == "off":
        raise ConfigError("compute.fp8_gather=true gathers ZeRO-3's weights as the fp8 recipe casts them: set "
                          f"--fp8 {GATHERED[0]} too")
    if name not in GATHERED:
        raise ConfigError(f"compute.fp8_gather=true with compute.fp8={name}: {NOT_GATHERED[name]}; use --fp8 "
                          f"{GATHERED[0]}, or drop --fp8-gather")


def gathered_in_fp8(uses: dict[str, list[WeightUse]], tp_local_shapes: dict[str, tuple[int, ...]],
                    fp8_filter: Fp8Filter = Fp8Filter()) -> frozenset[str]:
    """The parameters an fp8 gather may carry in fp8: those every weight matmul reading them
    (``uses``, from ``models.weight_uses``) casts to fp8 — the filter accepts the role and the
    2-D weight a rank multiplies, its ``tp_local_shapes`` slice flattened — so that the fp8
    values are exactly what the matmul would cast. Any other reader (a lookup, the head, the
    router) needs the weight in the compute precision, and the gather sends it so."""
    out = set()
    for path, reads in uses.items():
        local = tp_local_shapes.get(path)
        if local is None:
            continue
        shapes = [use.local_matmul_shape(local) for use in reads]
        if all(shape is not None and fp8_filter.accepts_shape(shape, use.role) for use, shape in zip(reads, shapes)):
            out.add(path)
    return frozenset(out)


def tensorwise_scales(weights: list[torch.Tensor], reduce_amax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The tensorwise e4m3 scales (fp8 max / amax, as torchao's ``amax_to_scale``) of
    ``weights``, each amax taken over the whole weight: ``reduce_amax`` maxes the stacked
    amaxes of this rank's pieces over the ranks holding the others."""
    from torchao.float8.float8_utils import amax_to_scale  # the fp8 extra
    # aten's op: dynamo skips the torch._foreach_max binding
    amax = reduce_amax(torch.stack(torch.ops.aten._foreach_max.default(torch._foreach_abs(weights))).float())
    return amax_to_scale(amax, E4M3)


def to_fp8_bits(weights: list[torch.Tensor], scales: torch.Tensor) -> list[torch.Tensor]:
    """``weights`` cast to e4m3 with ``scales`` (saturated, as torchao's ``to_fp8_saturated``),
    as uint8 for transport (every backend moves bytes). Foreach ops: ZeRO-3's checkpoint
    recomputes them in the backward rather than keeping their outputs (``parallel.zero3``)."""
    fmax = torch.finfo(E4M3).max
    scaled = torch._foreach_mul([w.float() for w in weights], list(scales.unbind()))
    clamped = torch._foreach_clamp_max(torch._foreach_clamp_min(scaled, -fmax), fmax)
    return [c.to(E4M3).view(torch.uint8) for c in clamped]


def from_fp8_bits(bits: list[torch.Tensor], scales: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The weights ``to_fp8_bits`` sent, dequantised to ``dtype``: their fp8 values divided by
    their scales. The matmul's tensorwise cast of them gives back the same fp8 values (each
    is within rounding of one, and fp8's spacing is 2^-3 of it), with a scale equal to
    ``scales`` to the rounding of ``dtype``."""
    values = torch._foreach_div([b.view(E4M3).float() for b in bits], list(scales.unbind()))
    return [v.to(dtype) for v in values]


def emulated(device: torch.device) -> bool:
    """Whether fp8 matmuls must be emulated on ``device`` (no fp8 tensor cores)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < MIN_CAPABILITY


def describe(name: str, device: torch.device, matmuls: tuple[int, int] | None = None,
             fp8_filter: Fp8Filter = Fp8Filter()) -> str:
    """The header's line: the recipe, where it applies (``matmuls``: how many of how many linear
    matmuls it takes), and whether it is emulated."""
    if name == "off":
        return "fp8 off"
    how = "emulated (fp8 casts and scales, fp32 matmuls: no fp8 tensor cores here)" if emulated(device) \
        else "on fp8 tensor cores"
    count = f" ({matmuls[0]} of {matmuls[1]} linear matmuls)" if matmuls is not None else ""
    return (f"fp8 {name} on {fp8_filter.describe()}{count}, {how}; router, experts, head, attention in the "
            f"compute precision")


def check_applies(name: str, matmuls: tuple[int, int], d_model: int) -> None:
    """A recipe that would take none of the model's linear matmuls is refused: the run would be
    the compute precision's, bit for bit, under a header that says fp8."""
    taken, linear = matmuls
    if taken == 0:
        raise ConfigError(f"compute.fp8={name}: none of the model's {linear} linear matmuls has both weight dims "
                          f"multiples of {DIM_MULTIPLE} (on a rank's tp slice), so nothing would run in fp8 "
                          f"(model.d_model={d_model}): make the widths multiples of {DIM_MULTIPLE}, or drop --fp8")


@functools.cache
def recipe(name: str, emulate: bool, fp8_filter: Fp8Filter = Fp8Filter()) -> MatmulRecipe:
    """The ``MatmulRecipe`` of ``compute.fp8=name`` (one object per arguments: a traced step
    guards on the active recipe, so the same one must come back each time)."""
    check_recipe(name)
    try:
        from torchao.float8 import Float8LinearConfig  # the fp8 extra
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as e:
        raise ConfigError(f"compute.fp8={name} runs through torchao, which is not installed "
                          f"({e}): pip install 'fxmega[fp8]'") from e
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=emulate)
    gemm = [config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight]
    mm_config = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemm))

    def fp8_matmul(x: torch.Tensor, w: torch.Tensor, role: str) -> torch.Tensor:
        if not fp8_filter.accepts(w, role):
            return plain_matmul(x, w, role)
        return matmul_with_hp_or_float8_args.apply(x, w, mm_config, config)

    return MatmulRecipe(f"fp8-{name}", fp8_matmul)


def recipe_for(name: str, device: torch.device) -> MatmulRecipe:
    """The weight matmuls of ``compute.fp8=name`` on ``device``: plain when off."""
    return PLAIN if name == "off" else recipe(name, emulated(device))
