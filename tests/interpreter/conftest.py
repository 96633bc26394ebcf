"""Fixtures shared by the interpreter tests: tiny families exported once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.generation import generate
from mlx_pte.interpreter.program import load
from mlx_pte.interpreter.sampling import SamplingParams

MAX_STEP = 32


def exported_pte(tmp_path_factory, tiny_checkpoint, family: str) -> Path:
    """The family's tiny checkpoint exported once per test session (shared by test files)."""
    path = tmp_path_factory.getbasetemp() / "engine_pte" / f"{family}.pte"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        export_hf(tiny_checkpoint(family), path, max_step=MAX_STEP, progress=False)
    return path


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


