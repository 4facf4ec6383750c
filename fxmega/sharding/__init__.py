"""The sharding annotations: logical axis names on tensors (``layout``), device meshes, rules
from logical to mesh axes, pipeline stage splits, and the planner that turns a spec tree into
DTensor placements, all as plain data that models and ops may import. What runs them on ranks
is ``fxmega.parallel``."""
