"""The standard-library code corpus: test suites and third-party packages left out, files
with the same contents kept once, documents in an order fixed by their paths."""

from __future__ import annotations

import json

from fxmega.data.code_corpus import stdlib_files, write_code_corpus


def test_corpus_from_a_tree(tmp_path):
    root = tmp_path / "lib"
    for rel, text in {"a.py": "x = 1\n", "pkg/b.py": "y = 2\n", "pkg/same.py": "x = 1\n",
                      "test/test_a.py": "assert 1\n", "pkg/tests/t.py": "t\n",
                      "site-packages/numpy/x.py": "n\n", "README.txt": "not code\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert [p.relative_to(root).as_posix() for p in stdlib_files(root)] == ["a.py", "pkg/b.py", "pkg/same.py"]
    written, dropped = write_code_corpus(tmp_path / "code.jsonl", root)
    assert (written, dropped) == (2, 1)
    docs = [json.loads(line) for line in (tmp_path / "code.jsonl").read_text().splitlines()]
    assert sorted(d["text"] for d in docs) == ["x = 1\n", "y = 2\n"]
    write_code_corpus(tmp_path / "again.jsonl", root)  # the same order every time
    assert (tmp_path / "again.jsonl").read_text() == (tmp_path / "code.jsonl").read_text()


def test_the_real_standard_library_is_there():
    files = stdlib_files()
    names = {p.name for p in files}
    assert len(files) > 300 and {"os.py", "functools.py", "__init__.py"} <= names
    assert not any("test" in p.parts or "site-packages" in p.parts for p in files)
