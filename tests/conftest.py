"""Session fixtures: tiny offline HF checkpoints and their exported programs, each built once on first use."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch  # before anything loads OpenBLAS (see mlx_pte/runtime/mlx/blas.py)

from mlx_pte.interpreter.program import load
from mlx_pte.serving.generation import generate
from mlx_pte.serving.sampling.params import SamplingParams
from tests.fixtures.exported import exported_pte
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


@pytest.fixture(scope="session")
def programs(tmp_path_factory, tiny_checkpoint):
    """``programs(family)`` -> the loaded program, exported once."""
    loaded: dict = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load(exported_pte(tmp_path_factory, tiny_checkpoint, family))
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def program(programs):
    return programs("llama")


@pytest.fixture(scope="session")
def oracle(programs):
    """``oracle(prompt, max_tokens, sampling, family)`` -> GenerationResult of generate() on a
    single-sequence session of that family."""
    memo: dict = {}
    sessions: dict = {}

    def run(prompt, max_tokens, sampling=SamplingParams(), family="llama"):
        key = (tuple(prompt) if not isinstance(prompt, str) else prompt, max_tokens, sampling, family)
        if key not in memo:
            if family not in sessions:
                sessions[family] = programs(family).session("single")
            single = sessions[family]
            single.cache.clear()
            memo[key] = generate(single, prompt, max_tokens, sampling, stop_on_eos=False)
        return memo[key]

    return run


