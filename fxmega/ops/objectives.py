"""Training objectives: what a step minimises, as an argument rather than a code path.

An objective is a function ``(outputs, batch) -> (sum, count)``: the summed loss of one
micro batch, honouring every mask in it, and how many terms that sum has. The step divides
the sum by the count of the whole global batch (``global_count``), in the same way on one
device, across data ranks, across micro batches and on a pipeline's last stage, so a loss
never depends on how the batch was split.

``batch_keys`` names what the objective reads from the batch besides the model's outputs;
a pipeline carries exactly those to its last stage. An objective that ``reads_reference``
(DPO's, a distillation's) also finds a frozen second model's outputs for the same batch
under ``batch[REFERENCE_OUTPUTS]``, laid out as ``outputs`` are (vocab-parallel under tp);
the run computes them without gradient (``fxmega.training.reference``). A term is counted when its
``loss_mask`` is non-zero (every target when the batch has no mask): padding, unmasked
MLM positions and padded classification rows are out of both the sum and the count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fxmega.ops import layers

Batch = Mapping[str, torch.Tensor]
REFERENCE_OUTPUTS = "reference_outputs"  # the batch key of the frozen reference model's outputs


class Objective(Protocol):
    """What the step calls; see the module docstring."""

    name: str
    batch_keys: tuple[str, ...]
    sum_shape: tuple[int, ...]  # the shape of the sum it returns: () for a loss
    reads_reference: bool  # True: it reads batch[REFERENCE_OUTPUTS], a frozen model's outputs

    def __call__(self, outputs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]: ...


def count(batch: Batch) -> torch.Tensor:
    """The number of loss terms in ``batch``: the sum of ``loss_mask``, else every target."""
    mask = batch.get("loss_mask")
    if mask is not None:  # float64: a 0/1 sum stays exact past float32's 2**24
        return mask.detach().double().sum()
    return torch.tensor(float(batch["targets"].numel()), dtype=torch.float64)


def global_count(micro_batches: Sequence[Batch]) -> torch.Tensor:
    """The loss-term count of a whole global batch (or of what ``micro_batches`` hold), on
    the host: the divisor of every micro batch's summed loss."""
    return torch.stack([count(b).cpu() for b in micro_batches]).sum().to(torch.float32)


@dataclass(frozen=True)
class CrossEntropy:
    """Summed cross-entropy of ``outputs [..., V]`` (logits; vocab-parallel under tensor
    parallelism) against ``batch["targets"] [...]``, weighted by ``batch["loss_mask"]`` where
    the batch has one. Columns from ``n_classes`` on (tensor-parallel padding of the
    vocabulary) are out of the softmax."""

    name: str
    n_classes: int
    class_axis: str = "vocab"  # the logical name of the logits' last dim
    batch_keys: tuple[str, ...] = ("targets", "loss_mask")
    sum_shape: tuple[int, ...] = ()
    reads_reference: bool = False

    def __call__(self, outputs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss = layers.cross_entropy_sum(outputs, batch["targets"], batch.get("loss_mask"), self.n_classes,
                                        self.class_axis)
        return loss, count(batch)


@dataclass(frozen=True)
class LossAndCorrect:
    """For evaluating a classifier in one pass: ``[summed cross-entropy, correct
    predictions]`` (each counted where ``loss_mask`` is non-zero) and the count."""

    name: str
    n_classes: int
    batch_keys: tuple[str, ...] = ("targets", "loss_mask")
    sum_shape: tuple[int, ...] = (2,)
    reads_reference: bool = False

    def __call__(self, outputs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss, n = CrossEntropy(self.name, self.n_classes, "classes")(outputs, batch)
        right = (outputs.argmax(dim=-1) == batch["targets"]).float()
        mask = batch.get("loss_mask")
        return torch.stack([loss, (right * mask).sum() if mask is not None else right.sum()]), n


def causal_lm(vocab_size: int) -> CrossEntropy:
    """Next-token prediction: ``targets`` are the inputs shifted by one."""
    return CrossEntropy("causal-lm", vocab_size)


def masked_lm(vocab_size: int) -> CrossEntropy:
    """Masked-token prediction (BERT): ``loss_mask`` marks the masked positions."""
    return CrossEntropy("masked-lm", vocab_size)


def classification(n_classes: int) -> CrossEntropy:
    """One label per sequence: ``targets [B]``, ``loss_mask [B]`` leaves padded rows out."""
    return CrossEntropy("classification", n_classes, "classes")


def classification_eval(n_classes: int) -> LossAndCorrect:
    """``classification``'s loss and the number of right answers, from the same logits."""
    return LossAndCorrect("classification", n_classes)
