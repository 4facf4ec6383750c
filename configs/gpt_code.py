"""A small code model: a GPT on bytes trained on the Python standard library's own sources
(``fxmega.data.code_corpus``, preprocessed into an indexed dataset; Megatron's split by
document gives train and validation sets of whole files), with a context of 1,024 bytes so
that most HumanEval prompts fit beside their completion. The recipe: examples/code."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import gpt

config = RunConfig(
    name="gpt_code",
    model=gpt.Config(vocab_size=256, max_seq_len=1024, d_model=256, n_layers=6, n_heads=4),
    train=TrainConfig(steps=300, micro_batch_size=8, global_batch_size=8, seq_len=1024, eval_interval=100,
                      eval_iters=3, log_interval=20, sample_tokens=0),
    optim=OptimConfig(lr=2e-3, min_lr=1e-4, warmup_steps=30, weight_decay=0.01),
    data=DataConfig(source="data/code/stdlib_text_document", tokenizer="byte", split="949,50,1"),
)
