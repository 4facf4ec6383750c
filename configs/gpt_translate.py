"""English -> French translation with a small decoder-only GPT on bytes, instruction-tuned on
the chat template (``data.task=sft``: the source is the user's message, the translation the
assistant's, the loss on the latter only): the same pairs as configs/t5_translate.py, for the
comparison in examples/translate."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import gpt

config = RunConfig(
    name="gpt_translate",
    model=gpt.Config(vocab_size=256, max_seq_len=256, d_model=256, n_layers=6, n_heads=4),
    train=TrainConfig(steps=600, micro_batch_size=32, global_batch_size=32, seq_len=256, eval_interval=100,
                      eval_iters=3, log_interval=20, sample_tokens=0),
    optim=OptimConfig(lr=2e-3, min_lr=1e-4, warmup_steps=50, weight_decay=0.01),
    data=DataConfig(task="sft", source="data/translation/en-fr.train.jsonl",
                    valid_source="data/translation/en-fr.valid.jsonl"),
)
