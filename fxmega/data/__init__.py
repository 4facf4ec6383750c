"""Data: corpora, tokenizers and the batches a training step consumes."""
