"""``run_prompts_file``: plain and JSONL prompt files through the engine, against generate()."""
from __future__ import annotations

import io
import json
import re

import pytest

from mlx_pte.serving.engine import Engine
from mlx_pte.serving.openai.prompts_file import PromptsFileError, run_prompts_file
from mlx_pte.serving.sampling.params import SamplingParams


GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def completions(printed: str) -> list[str]:
    """The completion texts printed, in order (each follows its '--- line N ...' header)."""
    body, _, summary = printed.rpartition("\n=== ")
    assert summary
    blocks = re.split(r"^--- line \d+ \(\d+ prompt tokens, \d+ generated, \w+\)\n", body + "\n", flags=re.M)
    assert blocks[0] == ""
    return [block[:-1] for block in blocks[1:]]


def test_plain_lines_run_together_in_file_order(program, oracle, tmp_path):  # noqa: F811
    prompts = ["def main():", "The quick brown", "import os"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts[:2]) + "\n\n" + prompts[2] + "\n")
    out = io.StringIO()
    stats = run_prompts_file(Engine(program, "batched-sequence", capacity=300), path, GREEDY, out)
    assert completions(out.getvalue()) == [oracle(p, 6).text for p in prompts]
    assert stats.generated_tokens == 18
    assert "=== 3 requests" in out.getvalue() and "tok/s" in out.getvalue()


def test_jsonl_lines_override_the_defaults(program, oracle, tmp_path):  # noqa: F811
    sampled = SamplingParams(temperature=1.0, seed=3)
    lines = [
        {"prompt": "def main():"},
        {"prompt": "The quick brown", "max_tokens": 3},
        {"prompt": "import os", "temperature": 1.0, "seed": 3},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = io.StringIO()
    run_prompts_file(Engine(program, "batched-cell", capacity=300), path, GREEDY, out)
    assert completions(out.getvalue()) == [
        oracle("def main():", 6).text,
        oracle("The quick brown", 3).text,
        oracle("import os", 6, sampled).text,
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "hi"}\nnot json\n', r":2: expected a JSON object"),
        ('{"prompt": "hi"}\n{"prompt": "hi", "max_tokens": 100000}\n', r":2: .*maximum context length"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_files_fail_before_anything_runs(program, tmp_path, text, message):  # noqa: F811
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    engine = Engine(program, "batched-sequence", capacity=300)
    with pytest.raises(PromptsFileError, match=message):
        run_prompts_file(engine, path, GREEDY, io.StringIO())
    assert engine.stats.steps == 0
