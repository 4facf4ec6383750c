"""Inference: a checkpoint's parameters without training state, one generation loop on any
mesh, and the HTTP server (one device or a mesh)."""
