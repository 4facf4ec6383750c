"""Translation quality on held-out pairs: each source translated greedily, scored with
sacrebleu's corpus BLEU and chrF against the references, next to the copy-source baseline
(the source itself as the translation: what a model must beat to have learned more than
copying). An encoder–decoder translates the source (``seq2seq_translator``); a decoder-only
model fine-tuned on the chat template answers the source as the user's message
(``fxmega.inference.chat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fxmega.inference.chat import Answerer, chat_answerer
from fxmega.inference.model_loader import LoadedModel
from fxmega.inference.seq2seq import ended, generate_seq2seq, is_encoder_decoder
from fxmega.models.family import ModelConfig

Translator = Answerer  # sources in, translations out


def seq2seq_translator(model: Any, params: dict, cfg: ModelConfig, tokenizer: Any, max_new_tokens: int,
                       batch_size: int = 32) -> Translator:
    """Greedy translations by an encoder–decoder, ``batch_size`` sources at a time (each cut to
    the model's ``encoder_seq_len`` tokens and ended with EOS, as in training)."""
    def translate(sources: Sequence[str]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(sources), batch_size):
            ids = ended([tokenizer.encode(s)[:cfg.encoder_seq_len - 1] for s in sources[i:i + batch_size]],
                        cfg.eos_id)
            out += [tokenizer.decode(t) for t in generate_seq2seq(model, params, cfg, ids, max_new_tokens)]
        return out
    return translate


def translator_for(run: LoadedModel, max_new_tokens: int) -> Translator:
    """The translator that fits ``run``'s model."""
    if is_encoder_decoder(run.model):
        return seq2seq_translator(run.model, run.params, run.cfg.model, run.tokenizer, max_new_tokens)
    return chat_answerer(run, max_new_tokens)


def scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """sacrebleu's corpus BLEU (13a tokenization) and chrF of ``hypotheses`` against one
    reference each."""
    import sacrebleu  # the recipes extra

    return {"bleu": sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score,
            "chrf": sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score}


def evaluate_translation(translate: Translator, pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """BLEU and chrF of ``translate``'s output for ``pairs``' sources, and of copying the
    source; with the translations themselves (``hypotheses``)."""
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
    hypotheses = translate(sources)
    copy = scores(sources, references)
    return {"pairs": len(pairs), **scores(hypotheses, references), "copy_bleu": copy["bleu"],
            "copy_chrf": copy["chrf"], "hypotheses": hypotheses}
