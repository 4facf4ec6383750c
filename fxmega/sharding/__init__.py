"""Sharding: device meshes, rules from logical axis names to mesh axes, the planner that
turns a spec tree into DTensor placements, and activation layouts used by model code."""
