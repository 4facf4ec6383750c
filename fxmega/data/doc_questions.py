"""Question–answer pairs from documentation that is on every machine: the docstrings of the
Python standard library.

For each public function, class and method in the standard library's sources (the files of
``fxmega.data.code_corpus.stdlib_files``, parsed with ``ast``, never imported), the question
"What does `module.name` do?" ("What is `module.Name`?" for a class) and as its answer the
docstring's summary sentence (PEP 257's first line, here its first sentence): a short answer
written by the library's authors, so exact match and token F1 against it mean something.
Names with a private part (``_x``) are left out, and so are summaries under 3 words, over 200
characters or not ASCII; each qualified name once (the first file's).

About 5,400 pairs on CPython 3.11, split 90/5/5 by a hash of the qualified name (the same on
every machine with the same Python), written as ``{"prompt", "response", "name"}`` JSON lines
under the data directory (never committed). A model answers held-out questions from the
name alone (``tkinter.Canvas.select_item`` → "Return the item which has the selection."):
what it can learn is how the library's authors phrase what a name does.

The same summaries make a topic-classification set (``ensure_doc_topics``): each summary's
label is the top-level package it documents, for the packages with the most documented
names (tkinter, idlelib, asyncio, distutils, logging, xml, email, lib2to3 on CPython 3.11:
2,389 summaries), written as ``{"text", "label", "name"}`` lines for ``run.py finetune``.
"""

from __future__ import annotations

import ast
import collections
import json
import os
import re
import sysconfig
from pathlib import Path

from fxmega.core.errors import DataError
from fxmega.data.code_corpus import stdlib_files
from fxmega.data.parallel_text import split_by_hash

SPLITS = ("train", "valid", "test")
MAX_ANSWER_CHARS = 200
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def summary(doc: str) -> str:
    """A docstring's first sentence: its first paragraph on one line, cut after the first
    ``.``, ``!`` or ``?`` that a space follows."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    end = _SENTENCE_END.search(text)
    return text[:end.start()] if end else text


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _answerable(text: str) -> bool:
    return len(text.split()) >= 3 and len(text) <= MAX_ANSWER_CHARS and text.isascii()


def _definitions(nodes: list[ast.stmt], prefix: str, out: dict[str, tuple[str, str]], depth: int = 0) -> None:
    # top-level functions and classes, and the methods of top-level classes
    for node in nodes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        name = f"{prefix}.{node.name}"
        doc = ast.get_docstring(node)
        if doc and _answerable(answer := summary(doc)):
            question = f"What is `{name}`?" if isinstance(node, ast.ClassDef) else f"What does `{name}` do?"
            out.setdefault(name, (question, answer))
        if isinstance(node, ast.ClassDef) and depth == 0:
            _definitions(node.body, name, out, depth + 1)


def doc_pairs(root: str | Path | None = None) -> dict[str, tuple[str, str]]:
    """``{qualified name: (question, answer)}`` for the sources under ``root`` (the standard
    library by default), in path order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out: dict[str, tuple[str, str]] = {}
    for path in stdlib_files(root):
        module = module_name(path, root)
        if not module or any(part.startswith("_") for part in module.split(".")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # lib2to3's test data and the like
            continue
        _definitions(tree.body, module, out)
    return out


def _write_splits(paths: dict[str, Path], rows: list[dict[str, str]]) -> None:
    # each split by a hash of the qualified name, written beside its path and renamed (atomic)
    paths["train"].parent.mkdir(parents=True, exist_ok=True)
    for split, path in paths.items():
        partial = path.with_suffix(".partial")
        with open(partial, "w", encoding="utf-8") as f:
            for row in rows:
                if split_by_hash(row["name"]) == split:
                    f.write(json.dumps(row) + "\n")
        os.replace(partial, path)


def ensure_doc_questions(data_dir: str | Path, root: str | Path | None = None) -> dict[str, Path]:
    """The ``{"prompt", "response", "name"}`` JSON-lines file of each split (see the module
    docstring), built on first use; ``{split: path}``. Each written atomically."""
    folder = Path(data_dir) / "qa"
    paths = {s: folder / f"stdlib-docs.{s}.jsonl" for s in SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    pairs = doc_pairs(root)
    if not pairs:
        raise DataError(f"no documented public functions or classes under {root or 'the standard library'}")
    _write_splits(paths, [{"prompt": q, "response": a, "name": name} for name, (q, a) in pairs.items()])
    return paths


def ensure_doc_topics(data_dir: str | Path, root: str | Path | None = None, topics: int = 8) -> dict[str, Path]:
    """The ``{"text", "label", "name"}`` JSON-lines file of each split: every summary of the
    ``topics`` top-level packages with the most documented names, labelled with its package
    (see the module docstring); built on first use, ``{split: path}``."""
    folder = Path(data_dir) / "classify"
    paths = {s: folder / f"stdlib-topics.{s}.jsonl" for s in SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    pairs = doc_pairs(root)
    packages = collections.Counter(name.split(".")[0] for name in pairs)
    kept = {package for package, _ in packages.most_common(topics)}
    if len(kept) < 2:
        raise DataError(f"the sources under {root or 'the standard library'} document {len(kept)} package(s); "
                        f"topic classification needs at least two")
    _write_splits(paths, [{"text": answer, "label": name.split(".")[0], "name": name}
                          for name, (_, answer) in pairs.items() if name.split(".")[0] in kept])
    return paths
