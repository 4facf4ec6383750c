"""Planning and inspection: a mesh traced on fake process groups, the plan report (shardings,
memory, collectives, kernels), the automatic layout search, and the model summary."""
