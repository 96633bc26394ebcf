"""Session fixtures: tiny offline HF checkpoints, each built once on first use."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch  # before anything loads OpenBLAS (see mlx_pte/runtime/mlx/blas.py)

from tests.fixtures.tiny_models import build_tiny_checkpoint, build_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer) -> Callable[[str], Path]:
    """``tiny_checkpoint(family) -> Path`` of that family's checkpoint, built once per session."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_checkpoint(family, root / family, tokenizer=tiny_tokenizer)
        return built[family]

    return get


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tests run tiny models: intra-op threads only add synchronisation on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
