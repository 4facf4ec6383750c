"""Topic classification of the standard library's docstring summaries (which of eight
top-level packages a summary documents; ``fxmega.data.doc_questions.ensure_doc_topics``) by
fine-tuning the pretrained all-MiniLM-L6-v2 (a 6-layer BERT, ``fxmega.storage.pretrained``)
with a linear head on its pooler. ``run.py finetune --load data/models/all-MiniLM-L6-v2``
replaces the model section by the checkpoint's own config. The recipe: examples/classify."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import bert

config = RunConfig(
    name="minilm_topics",
    model=bert.Config(vocab_size=30522, max_seq_len=512, d_model=384, n_layers=6, n_heads=12, d_ff=1536),
    train=TrainConfig(steps=300, micro_batch_size=32, global_batch_size=32, seq_len=64, eval_interval=100,
                      eval_iters=4, log_interval=20, sample_tokens=0),
    optim=OptimConfig(lr=5e-5, min_lr=5e-6, warmup_steps=30, weight_decay=0.01),
    data=DataConfig(tokenizer="hf:data/models/all-MiniLM-L6-v2/tokenizer.json"),
)
