"""Core: errors, parameter specs with logical axis names, pytree helpers, JSON files,
devices, memory and precision helpers, and the kernel/graph dump; imports nothing above it."""
