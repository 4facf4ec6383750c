"""Translation quality on held-out pairs: each source translated greedily, scored with
sacrebleu's corpus BLEU and chrF against the references, next to the copy-source baseline
(the source itself as the translation: what a model must beat to have learned more than
copying). An encoder–decoder translates the source (``seq2seq_translator``); a decoder-only
model fine-tuned on the chat template answers the source as the user's message
(``chat_translator``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fxmega.data.instructions import END, prompt_text
from fxmega.inference.generation_cli import generate_texts
from fxmega.inference.model_loader import LoadedModel
from fxmega.inference.seq2seq import ended, generate_seq2seq, is_encoder_decoder

Translator = Callable[[Sequence[str]], list[str]]


def seq2seq_translator(model: Any, params: dict, cfg: Any, tokenizer: Any, max_new_tokens: int,
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


def chat_translator(run: LoadedModel, max_new_tokens: int, batch_size: int = 32) -> Translator:
    """Greedy answers of a decoder-only model to each source as the user's message (the chat
    template of ``fxmega.data.instructions``), cut at the template's end of message. The
    prompt and the answer share the model's context: a prompt longer than half of it has its
    source cut (as training cuts samples), and each batch generates at most what is left."""
    tok, limit = run.tokenizer, run.cfg.model.max_seq_len

    def prompt(source: str) -> str:
        text = prompt_text([{"role": "user", "content": source}])
        over = len(tok.encode(text)) - limit // 2
        if over > 0:
            ids = tok.encode(source)
            text = prompt_text([{"role": "user", "content": tok.decode(ids[:max(len(ids) - over, 1)])}])
        return text

    def translate(sources: Sequence[str]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(sources), batch_size):
            prompts = [prompt(s) for s in sources[i:i + batch_size]]
            room = limit - max(len(tok.encode(p)) for p in prompts)
            out += generate_texts(run, prompts, min(max_new_tokens, room), 0.0, 0, 1.0, [END], 0)
        return out
    return translate


def translator_for(run: LoadedModel, max_new_tokens: int) -> Translator:
    """The translator that fits ``run``'s model."""
    if is_encoder_decoder(run.model):
        return seq2seq_translator(run.model, run.params, run.cfg.model, run.tokenizer, max_new_tokens)
    return chat_translator(run, max_new_tokens)


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
