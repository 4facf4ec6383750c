"""Optimizers behind one interface (``optimizer.Optimizer``): per-element state declared as
specs that the plan shards like the parameters' optimizer layout and the memory tables
count, and an update that is a pure function over lists of tensors. AdamW is the first;
another registers here with ``optimizer.register(name, build)``."""

from fxmega.optim import adamw, optimizer

optimizer.register("adamw", adamw.from_config)
