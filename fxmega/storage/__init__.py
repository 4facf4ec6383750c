"""Checkpoints and conversion: DCP saves (atomic, verified, reshardable), what a run saves,
and Hugging Face / orbax interop."""
