"""Building blocks: the pure functions models are made of (layers, losses, training objectives,
recompute policies, parameter init) and the optional Triton kernels behind them."""
