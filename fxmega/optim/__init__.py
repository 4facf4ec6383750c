"""Optimizers behind one interface (``optimizer.Optimizer``): per-element state declared as
specs that the plan shards like the parameters' optimizer layout and the memory tables
count, and an update that is a pure function over lists of tensors. AdamW is the first,
Muon (for the hidden matrices, AdamW for the rest) the second; another registers here
with ``optimizer.register(name, build)``."""

from fxmega.optim import adamw, muon, optimizer

optimizer.register("adamw", adamw.from_config)
optimizer.register("muon", muon.from_config)
