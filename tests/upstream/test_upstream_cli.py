"""The user's path for upstream files: `mlx-pte inspect|run|bench|serve upstream.pte
--tokenizer HF_DIR`, and one clear error when text is asked for without a tokenizer."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM

from mlx_pte.cli import main
from mlx_pte.serving.generation import generate
from mlx_pte.interpreter.program import load
from mlx_pte.serving.openai.app import create_app
from mlx_pte.serving.engine import open_engine
from mlx_pte.interpreter.text import TokenizerMissing
from tests.interpreter.test_cli_run import one_error_line

PROMPT = "The for statement"
NEW_TOKENS = 8


# ~40 s in all, most of it exporting upstream's files once: the slow tier runs this module.
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def files(upstream_pte, tiny_checkpoint):
    return upstream_pte("gemma3", "fp32"), tiny_checkpoint("gemma3")


@pytest.fixture(scope="module")
def hf_continuation(files, tiny_tokenizer) -> str:
    """What HF greedy decoding appends to PROMPT, as text."""
    _, checkpoint = files
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True).eval()
    ids = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)  # fmt: skip
    return tiny_tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_run_with_a_tokenizer_prints_hf_greedy_text(files, hf_continuation, capsys):
    pte, checkpoint = files
    argv = ["run", str(pte), "--tokenizer", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == PROMPT + hf_continuation
    assert "decode:" in out.err


def test_text_without_a_tokenizer_is_one_error_line(files, capsys):
    pte, _ = files
    assert main(["run", str(pte), "--prompt", PROMPT]) == 1
    assert "--tokenizer HF_DIR" in one_error_line(capsys.readouterr())
    with pytest.raises(TokenizerMissing, match="--tokenizer"):
        generate(load(pte).session(), PROMPT, max_new_tokens=1)


def test_a_tokenizer_dir_without_tokenizer_json_is_one_error_line(files, tmp_path, capsys):
    pte, _ = files
    assert main(["run", str(pte), "--tokenizer", str(tmp_path), "--prompt", PROMPT]) == 1
    assert "has no tokenizer.json" in one_error_line(capsys.readouterr())


def test_token_ids_need_no_tokenizer(files, hf_continuation, tiny_tokenizer):
    pte, _ = files
    ids = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    result = generate(load(pte).session("batched-cell"), ids, max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    assert tiny_tokenizer.decode(result.tokens, skip_special_tokens=True) == hf_continuation


def test_inspect_shows_the_published_geometry_and_the_given_tokenizer(files, capsys):
    pte, checkpoint = files
    assert main(["inspect", str(pte), "--tokenizer", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "update_and_attend  2" in out
    assert "0         4       2           16        16" in out  # the sliding cache: window 4
    assert '"source": "executorch-mlx"' in out and "<tokenizer.json:" in out


def test_bench_runs_without_a_tokenizer(files, capsys):
    pte, _ = files
    assert main(["bench", str(pte), "--prompt-tokens", "8", "--generate", "4", "--repeats", "1"]) == 0
    assert "decode" in capsys.readouterr().out


def test_serve_completes_text_with_the_given_tokenizer(files, hf_continuation):
    pte, checkpoint = files
    engine = open_engine(str(pte), "batched-sequence", capacity=256, tokenizer=str(checkpoint))
    with TestClient(create_app(engine, "gemma3-upstream")) as client:
        response = client.post(
            "/v1/completions",
            json={"model": "gemma3-upstream", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0},
        )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == hf_continuation


def test_an_upstream_file_runs_without_torch_or_executorch(files):
    pte, checkpoint = files
    code = (
        "import sys\n"
        "from mlx_pte import load, generate\n"
        f"program = load({str(pte)!r}, tokenizer={str(checkpoint)!r})\n"
        "print(generate(program.session('batched-sequence'), 'The for', max_new_tokens=4).text)\n"
        "heavy = [m for m in ('torch', 'executorch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_inspect_reports_an_upstream_files_quantized_weights(upstream_pte, capsys):
    assert main(["inspect", str(upstream_pte("llama", "fp32-4w"))]) == 0
    out = capsys.readouterr().out
    # 10 = 4 linears in each of 2 layers (q/k/v and gate/up fused at import), the LM head and
    # the embedding (tiny_models: untied).
    assert "quantized: 10 weights (affine 4-bit, groups of 32)" in out
    assert "quantized_embedding  1" in out and "quantized_linear     9" in out
