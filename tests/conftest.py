"""Test settings: deterministic CPU runs, and one inductor cache per test session so that
compiled graphs are reused across tests but never shared with other processes' caches."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor-tests"))

import torch  # noqa: E402

torch.use_deterministic_algorithms(True, warn_only=True)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts with no compiled graphs, so graph counts are its own."""
    import torch._dynamo

    torch._dynamo.reset()
    yield


@pytest.fixture
def tiny_gpt():
    from fxmega.config import load

    return load(ROOT / "configs" / "tiny_gpt.py")


@pytest.fixture
def tiny_llama():
    from fxmega.config import load

    return load(ROOT / "configs" / "tiny_llama.py")
