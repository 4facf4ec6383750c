"""Question answering on the standard library's documentation with a small decoder-only GPT on
bytes, instruction-tuned on the chat template (``data.task=sft``: the question is the user's
message, the docstring's summary the assistant's answer, the loss on the answer only), with
several conversations packed into each row behind document masks (``data.pack``). The data:
``fxmega.data.doc_questions``; the recipe: examples/qa."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import gpt

config = RunConfig(
    name="gpt_qa",
    model=gpt.Config(vocab_size=256, max_seq_len=256, d_model=256, n_layers=6, n_heads=4),
    train=TrainConfig(steps=500, micro_batch_size=32, global_batch_size=32, seq_len=256, eval_interval=100,
                      eval_iters=3, log_interval=20, sample_tokens=0),
    optim=OptimConfig(lr=2e-3, min_lr=1e-4, warmup_steps=50, weight_decay=0.01),
    data=DataConfig(task="sft", source="data/qa/stdlib-docs.train.jsonl",
                    valid_source="data/qa/stdlib-docs.valid.jsonl", pack=True),
)
