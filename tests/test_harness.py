"""lm-evaluation-harness on fxmega checkpoints: the scores it is given equal the model's own
training forward, and ``run.py eval --tasks`` runs a task and prints the harness's table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fxmega.cli import main, parse_args
from fxmega.cli.commands import checkpoint_config
from fxmega.config import load, override
from fxmega.core.errors import ConfigError
from fxmega.data.corpus import ensure_shakespeare
from fxmega.data.tokenizer import ByteTokenizer, _bytes_to_unicode
from fxmega.inference.model_loader import init_model, load_model
from fxmega.inference.scoring import continuation_logprobs, decoder_for
from fxmega.models import lm_loss_sum
from tests.commands import run_py, serving
from tests.conftest import ROOT
from tests.tolerance import reduction_rtol, run_lengths

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm-evaluation-harness) is not installed")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from fxmega.inference.harness import harness_model  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog. "
SHIPPED = "shakespeare_cloze"  # examples/harness' multiple-choice task


def _tiny(*overrides: str):
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), ["train.device=cpu", *overrides])
    run = init_model(cfg)
    run.tokenizer = ByteTokenizer()
    return run


def _training_forward_logprob(run, context: list[int], continuation: list[int]) -> float:
    """Minus the training objective's sum over the continuation's targets, the model read as in
    training: the whole window at once, no cache."""
    whole = [*context, *continuation][-(run.cfg.model.max_seq_len + 1):]
    inputs, targets = torch.tensor([whole[:-1]]), torch.tensor([whole[1:]])
    mask = torch.zeros_like(targets, dtype=torch.float32)
    mask[0, -len(continuation):] = 1
    with torch.no_grad():
        return -float(lm_loss_sum(run.params, {"inputs": inputs, "targets": targets, "loss_mask": mask},
                                  run.cfg.model))


def test_loglikelihood_equals_the_training_forward():
    """Each continuation's log-probability, scored in left-padded batches of mixed lengths
    (one context longer than the model's window, so cut to its end), equals minus the
    training loss summed over the same tokens."""
    run = _tiny()
    enc = ByteTokenizer().encode
    pairs = [(enc("the quick brown"), enc(" fox")), (enc("a"), enc("b")),
             (enc(TEXT * 3), enc("the end")),  # 142 + 7 tokens: the context keeps its last 57
             (enc("jumps over the lazy"), enc(" dog."))]
    got = continuation_logprobs(decoder_for(run), run.cfg.model, pairs, batch_size=3)
    # the same sums in another order (cached attention, padding, another batch shape): each
    # token's log-probability goes through the model's reductions; the sum adds the
    # continuation's length; terms are log-probabilities of magnitude up to ~ln(256)
    rtol = reduction_rtol(*run_lengths(run.cfg), max(len(c) for _, c in pairs))
    for (context, continuation), (logprob, _) in zip(pairs, got):
        want = _training_forward_logprob(run, context, continuation)
        assert logprob == pytest.approx(want, rel=rtol), (context[-5:], continuation)
    alone = [continuation_logprobs(decoder_for(run), run.cfg.model, [p], batch_size=1)[0] for p in pairs]
    assert [a for a, _ in alone] == pytest.approx([g for g, _ in got], rel=rtol)


def test_the_harness_model_answers_loglikelihood_with_greedy_flags():
    """Through lm-eval's own request objects: a continuation that is the model's greedy choice
    is flagged greedy, and the log-probabilities are the scorer's."""
    run = _tiny()
    lm = harness_model(run, batch_size=4)
    context = "the quick brown"
    ids = ByteTokenizer().encode(context)
    logits, _ = decoder_for(run).forward(torch.tensor([ids]), decoder_for(run).init_cache(1, len(ids)), 0,
                                         torch.zeros(1, dtype=torch.long), len(ids))
    greedy = bytes([int(logits[0, -1, :256].argmax())]).decode("latin-1")
    other = chr((ord(greedy) + 1) % 128)
    requests = [Instance("loglikelihood", {}, (context, c), i) for i, c in enumerate([greedy, other])]
    answers = lm.loglikelihood(requests)
    assert [flag for _, flag in answers] == [True, False]
    want = continuation_logprobs(decoder_for(run), run.cfg.model, [(ids, [ord(greedy)]), (ids, [ord(other)])])
    assert [a for a, _ in answers] == pytest.approx([w for w, _ in want], rel=1e-6)


def _example_tasks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("harness_tasks", ROOT / "examples" / "harness" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_task(folder: Path) -> list[dict]:
    """A multiple-choice task over a local JSONL file, in the example cloze's format: which word
    ends the sentence (the harness puts its target delimiter, a space, between the text and each
    choice)."""
    docs = [{"text": f"the quick brown fox jumps over the {w}", "choices": ["dog", "cat", "fox", "log"],
             "answer": a} for w, a in (("lazy", 0), ("lazy", 1), ("laz", 0), ("lazy", 2), ("the", 3), ("l", 0))]
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny_mc.yaml").write_text(_example_tasks().CLOZE.format(name="tiny_mc", data=folder / "docs.jsonl"))
    return docs


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny GPT trained 20 eager steps on a repeated sentence (byte tokens), saved."""
    folder = tmp_path_factory.mktemp("trained")
    (folder / "corpus.txt").write_text(TEXT * 200)
    assert main(["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--data-path", str(folder / "corpus.txt"),
                 "--steps", "20", "--no-compile", "--no-progress", "--save", str(folder / "ckpt")]) == 0
    return folder / "ckpt"


@pytest.mark.slow
def test_run_py_eval_tasks_prints_the_harness_table(trained, tmp_path):
    """``run.py eval --load CKPT --tasks ... --include-path DIR`` with a hand-made multiple-choice
    task and the two example tasks (examples/harness: a multiple-choice cloze and a generation
    task over Shakespeare): the harness's table with each task's metric, and the hand-made
    task's accuracy equal to the one computed from the scorer's log-probabilities directly."""
    ckpt, out = trained, tmp_path / "results.json"
    docs = _write_task(tmp_path)
    _example_tasks().build(ensure_shakespeare(ROOT / "data", quiet=True).read_text(), tmp_path, n=8)
    done = run_py("eval", "--load", str(ckpt), "--tasks", "tiny_mc,shakespeare_cloze,shakespeare_lines",
                  "--include-path", str(tmp_path), "--output-path", str(out))
    for row in ("|tiny_mc          |", "|shakespeare_cloze|", "|shakespeare_lines|", "|acc ", "|exact_match|"):
        assert row in done.stdout, (row, done.stdout)
    results = json.loads(out.read_text())["results"]
    assert 0 <= results["shakespeare_lines"]["exact_match,none"] <= 1
    acc = results["tiny_mc"]["acc,none"]

    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), [f"train.load_dir={ckpt}", "train.device=cpu"])
    run = load_model(cfg, with_tokenizer=False)
    enc = ByteTokenizer().encode
    correct = 0
    for doc in docs:
        scores = continuation_logprobs(decoder_for(run), run.cfg.model,
                                       [(enc(doc["text"]), enc(" " + c)) for c in doc["choices"]])
        correct += max(range(len(scores)), key=lambda i: scores[i][0]) == doc["answer"]
    assert acc == pytest.approx(correct / len(docs))
    assert 0 < correct < len(docs)  # the task tells answers apart: neither all right nor all wrong


class _BytesWithEnd(ByteTokenizer):
    """Bytes, with byte 0 standing for the end of a text (the harness's prefix token)."""

    eod = 0


def test_rolling_loglikelihood_scores_every_token_once_after_the_end_of_text_token():
    """A text that fits the context: the one rolling window is the text after the end-of-text
    token, every token scored, as the training objective scores it. A longer text: the sum
    of the harness's disjoint windows, each token counted once. The byte tokenizer, which has
    no end-of-text token, is refused with the reason."""
    run = _tiny()
    run.tokenizer = _BytesWithEnd()
    lm = harness_model(run, batch_size=4)
    short, long = "the quick brown fox", TEXT * 3
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), i)
                                    for i, text in enumerate([short, long])])
    ids = _BytesWithEnd().encode(short)
    rtol = reduction_rtol(*run_lengths(run.cfg), len(TEXT) * 3)
    assert got[0] == pytest.approx(_training_forward_logprob(run, [0], ids), rel=rtol)
    windows = [lm_eval.utils.make_disjoint_window(w) for w in
               lm_eval.utils.get_rolling_token_windows(_BytesWithEnd().encode(long), 0, run.cfg.model.max_seq_len, 1)]
    assert len(windows) > 1 and sum(len(c) for _, c in windows) == len(long)
    assert got[1] == pytest.approx(sum(_training_forward_logprob(run, c, t) for c, t in windows), rel=rtol)
    run.tokenizer = ByteTokenizer()
    with pytest.raises(ConfigError, match="byte tokenizer has no end-of-text token"):
        harness_model(run, batch_size=4).loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0)])


def test_generate_until_is_greedy_generation_cut_at_the_stop_strings():
    run = _tiny()
    lm = harness_model(run, batch_size=4)
    free = lm.generate_until([Instance("generate_until", {}, ("the quick", {"until": [], "max_gen_toks": 12}), 0)])[0]
    assert len(free) >= 5  # 12 bytes, some decoded as replacement characters
    stop = free[3:5]
    cut = lm.generate_until([Instance("generate_until", {}, ("the quick", {"until": [stop], "max_gen_toks": 12}), 0)])
    assert cut == [free[:free.index(stop)]]
    # batched with a longer and a shorter prompt, each generates what it generates alone
    prompts = ["the quick", "over the lazy dog and", "a"]
    alone = [lm.generate_until([Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 8}), 0)])[0]
             for p in prompts]
    together = lm.generate_until([Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 8}), i)
                                  for i, p in enumerate(prompts)])
    assert together == alone


def _hf_gpt2_with_byte_tokenizer(folder: Path) -> None:
    """A tiny random GPT-2 saved as Hugging Face saves one, with a byte-level tokenizer (each
    byte one token, plus an end-of-text token): what both lm-eval's ``hf`` model and
    ``run.py convert --from-hf`` read."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    alphabet = _bytes_to_unicode()  # GPT-2's printable stand-ins for bytes
    vocab = {alphabet[b]: b for b in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>",
                                         bos_token="<|endoftext|>").save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=257, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0,
                                  embd_pdrop=0, attn_pdrop=0, bos_token_id=256, eos_token_id=256)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # weights large enough that choices differ by more than rounding
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def hf_and_imported(tmp_path_factory) -> tuple[Path, Path, Path, list[dict], dict]:
    """A tiny random GPT-2 in a Hugging Face directory, the same weights imported with
    ``run.py convert --from-hf``, the multiple-choice task, and lm-eval's ``hf`` model's results
    on it, every request's answer included."""
    folder = tmp_path_factory.mktemp("hf")
    hf_dir, ckpt = folder / "hf", folder / "ckpt"
    _hf_gpt2_with_byte_tokenizer(hf_dir)
    assert main(["convert", "--from-hf", str(hf_dir), "--save", str(ckpt)]) == 0
    docs = _write_task(folder)
    _example_tasks().build(ensure_shakespeare(ROOT / "data", quiet=True).read_text(), folder, n=12)
    hf = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=4)
    reference = lm_eval.simple_evaluate(model=hf, tasks=[SHIPPED], bootstrap_iters=0, log_samples=True,
                                        task_manager=lm_eval.tasks.TaskManager(include_path=str(folder)))
    return hf_dir, ckpt, folder, docs, reference


def _answers(results: dict) -> dict[tuple[int, int], tuple[float, bool]]:
    """(document, choice) -> the model's (log-probability, greedy) in a results JSON's samples."""
    return {(s["doc_id"], i): tuple(r[0]) for s in results["samples"][SHIPPED] for i, r in enumerate(s["resps"])}


@pytest.mark.slow
def test_requests_through_the_adapter_equal_lm_evals_hf_model(hf_and_imported):
    """Every loglikelihood request of the task gets the same log-probability (within the
    rounding of two float32 forwards) and greedy flag from fxmega's adapter over the imported
    weights as from lm-eval's ``hf`` model (transformers) over the originals."""
    hf_dir, ckpt, _, docs, _ = hf_and_imported
    hf = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=4)
    ours = harness_model(load_model(checkpoint_config(parse_args(["eval", "--load", str(ckpt)]))), batch_size=4)
    requests = [Instance("loglikelihood", {}, (d["text"], " " + c), i)
                for i, d in enumerate(docs) for c in d["choices"]]
    got, want = ours.loglikelihood(requests), hf.loglikelihood(requests)
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), ["model.vocab_size=257"])
    rtol = reduction_rtol(*run_lengths(cfg), 8)
    assert [g for g, _ in got] == pytest.approx([w for w, _ in want], rel=rtol)
    assert [g for _, g in got] == [w for _, w in want]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(), ("--mesh", "tp=2"), ("--mesh", "pp=2")], ids=["one_device", "tp2", "pp2"])
def test_run_py_eval_tasks_equals_lm_evals_hf_model_on_the_same_weights(hf_and_imported, mesh, tmp_path):
    """``run.py eval --tasks shakespeare_cloze`` (the shipped multiple-choice task) on the
    imported weights, on one device, on tp=2 (the
    vocabulary of 257 padded to 258 there) and on pp=2: the harness's table, the ``hf`` model's accuracy,
    and each request's answer equal to the ``hf`` model's within the float32 rounding bound."""
    _, ckpt, folder, _, reference = hf_and_imported
    out = tmp_path / "results.json"
    done = run_py("eval", "--load", str(ckpt), "--tasks", SHIPPED, "--include-path", str(folder), *mesh,
                  "--output-path", str(out), "--log-samples")
    assert f"|{SHIPPED}|" in done.stdout, done.stdout
    results = json.loads(out.read_text())
    assert results["results"][SHIPPED]["acc,none"] == reference["results"][SHIPPED]["acc,none"]
    got, want = _answers(results), _answers(reference)
    assert sorted(got) == sorted(want)
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), ["model.vocab_size=257"])
    rtol = reduction_rtol(*run_lengths(cfg), 8)
    assert [got[k][0] for k in sorted(got)] == pytest.approx([want[k][0] for k in sorted(want)], rel=rtol)
    assert [got[k][1] for k in sorted(got)] == [want[k][1] for k in sorted(want)]


@pytest.mark.slow
def test_lm_evals_local_completions_against_run_py_serve_scores_as_the_direct_run(trained, tmp_path):
    """``lm_eval --model local-completions`` pointed at ``run.py serve``: the harness reads the
    served tokenizer (/tokenize), sends token ids with echo and logprobs, and gets the same
    log-probabilities, greedy flags and task accuracy as fxmega's model answering directly."""
    docs = _write_task(tmp_path)
    direct = harness_model(load_model(checkpoint_config(parse_args(["eval", "--load", str(trained)]))), batch_size=4)
    requests = [Instance("loglikelihood", {}, (d["text"], " " + c), i)
                for i, d in enumerate(docs) for c in d["choices"]]
    manager = lm_eval.tasks.TaskManager(include_path=str(tmp_path))
    want = lm_eval.simple_evaluate(model=direct, tasks=["tiny_mc"], task_manager=manager, bootstrap_iters=0)
    with serving(["--load", str(trained)]) as url:  # the completions URL the server prints
        with urllib.request.urlopen(url.replace("/v1/completions", "/v1/models"), timeout=30) as r:
            name = json.loads(r.read())["data"][0]["id"]
        served = lm_eval.api.registry.get_model("local-completions")(
            base_url=url, model=name, tokenizer_backend="remote", batch_size=4, max_length=direct.context - 1,
            num_concurrent=1, max_retries=1)
        got = served.loglikelihood(requests)
        # and as a user types it: lm-eval's own command line
        out = tmp_path / "served"
        typed = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                                f"base_url={url},model={name},tokenizer_backend=remote,num_concurrent=1,max_retries=1,"
                                f"max_length={direct.context - 1}", "--tasks", "tiny_mc", "--include_path",
                                str(tmp_path), "--output_path", str(out)], capture_output=True, text=True, timeout=600)
    assert typed.returncode == 0, typed.stdout[-2000:] + typed.stderr[-3000:]
    assert "|tiny_mc|" in typed.stdout, typed.stdout
    expected = direct.loglikelihood(requests)
    assert [g for g, _ in got] == pytest.approx([e for e, _ in expected], rel=1e-6)  # the same forward, batched alike
    assert [g for _, g in got] == [e for _, e in expected]
    (written,) = out.rglob("results*.json")
    assert json.loads(written.read_text())["results"]["tiny_mc"]["acc,none"] == want["results"]["tiny_mc"]["acc,none"]
