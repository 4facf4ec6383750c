"""fxmega: Megatron-style parallel training of transformer language models, built the
JAX/XLA way on PyTorch: pure model functions over parameter trees, logical axis names,
a sharding planner, and one compiled step."""

__version__ = "0.1.0"
