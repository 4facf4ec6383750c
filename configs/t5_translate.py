"""English -> French translation with a small T5 on bytes: the .po catalogues of Django and
Sphinx as parallel text (``fxmega.data.po_catalogues``; examples/translate). T5 v1.1's gated
GELU, the head tied to the embedding; the specials (pad 256, EOS 257) sit above the bytes."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import t5

config = RunConfig(
    name="t5_translate",
    model=t5.Config(vocab_size=258, encoder_seq_len=128, decoder_seq_len=128, d_model=256, n_encoder_layers=3,
                    n_decoder_layers=3, n_heads=4, d_kv=64, d_ff=768, ffn="gated-gelu", tie_embeddings=True,
                    pad_id=256, eos_id=257, n_sentinels=0),
    train=TrainConfig(steps=600, micro_batch_size=32, global_batch_size=32, seq_len=128, eval_interval=100,
                      eval_iters=3, log_interval=20, sample_tokens=0),
    optim=OptimConfig(lr=2e-3, min_lr=1e-4, warmup_steps=50, weight_decay=0.01),
    data=DataConfig(task="seq2seq", source="data/translation/en-fr.train.jsonl",
                    valid_source="data/translation/en-fr.valid.jsonl"),
)
