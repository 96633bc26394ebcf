"""`mlx-pte export --quantize` and `mlx-pte inspect` of a quantized file from the user's
side: the summary and the per-tensor report (sizes checked against arithmetic on MLX's
packing), and one error line, with nothing written, for every bad option."""
from __future__ import annotations

import re

import pytest

from mlx_pte.cli import main

from .test_cli_run import one_error_line

N_LAYERS, HIDDEN, FFN, VOCAB, Q, KV = 2, 64, 128, 1024, 64, 32
ALIGN = 128  # fused projections start each part at a multiple of 128 rows (ir.fuse_projections)
# Every linear and the (untied) embedding and head of the tiny llama, as [N, K]: q/k/v fused
# (q and k padded to 128 rows each), o, gate/up fused, down.
WEIGHTS = [(VOCAB, HIDDEN), (VOCAB, HIDDEN)] + N_LAYERS * [(2 * ALIGN + KV, HIDDEN), (HIDDEN, Q), (2 * FFN, HIDDEN),
                                                           (HIDDEN, FFN)]  # fmt: skip


def q4_bytes(n: int, k: int, group: int) -> int:
    """Affine 4-bit: k/8 uint32 words per row, and a float32 scale and bias per group."""
    return n * (k // 8) * 4 + 2 * n * (k // group) * 4


@pytest.fixture(scope="module")
def quantized_pte(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_q") / "q4.pte"
    args = ["export", str(tiny_checkpoint("llama")), "-o", str(out), "--max-step", "16", "--no-progress",
            "--quantize", "q4", "--group-size", "32"]  # fmt: skip
    return out, args


def test_export_prints_what_it_quantized(quantized_pte, capsys):
    out, args = quantized_pte
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert f"wrote {out}" in stdout
    assert re.search(rf"quantized: {len(WEIGHTS)} weights \(affine 4-bit, groups of 32\); all weights [\d,]+ bytes", stdout)


def test_inspect_shows_bits_group_mode_and_bytes_per_tensor_and_the_total(quantized_pte, capsys):
    out, args = quantized_pte
    if not out.exists():
        assert main(args) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("quantized weights:")
    assert lines[start + 1].split()[:6] == ["name", "logical", "mode", "bits", "group", "bytes"]
    row = re.compile(r"^  (\S+)\s+float32\[(\d+), (\d+)\]\s+(\S+)\s+(\d+)\s+(\d+)\s+([\d,]+)\s+([\d,]+)$")
    rows = [row.match(line).groups() for line in lines[start + 2 : start + 2 + len(WEIGHTS)]]
    assert sorted((int(r[1]), int(r[2])) for r in rows) == sorted(WEIGHTS)
    for _, n, k, mode, bits, group, nbytes, full in rows:
        n, k = int(n), int(k)
        assert (mode, bits, group) == ("affine", "4", "32")
        assert int(nbytes.replace(",", "")) == q4_bytes(n, k, 32)
        assert int(full.replace(",", "")) == n * k * 4
    total = next(line for line in lines if line.startswith("quantized: "))
    stored, full = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) (?:bytes|at full)", total))
    assert full - stored == sum(n * k * 4 - q4_bytes(n, k, 32) for n, k in WEIGHTS)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--quantize", "q4", "--group-size", "48"], "affine quantization takes group sizes 32, 64, 128, got 48"),
        (["--quantize", "nvfp4", "--group-size", "32"], "nvfp4 quantization takes group sizes 16, got 32"),
        (["--group-size", "64"], "--group-size needs --quantize"),
    ],
)
def test_a_bad_quantization_option_is_one_error_line_and_writes_nothing(tiny_checkpoint, tmp_path, capsys,
                                                                        options, message):  # fmt: skip
    out = tmp_path / "bad.pte"
    assert main(["export", str(tiny_checkpoint("llama")), "-o", str(out), "--no-progress", *options]) == 1
    assert message in one_error_line(capsys.readouterr())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # ~15 s: exports a checkpoint of its own
def test_weights_kept_at_full_precision_are_listed_after_export(tiny_checkpoint, tmp_path, capsys):
    """gemma3n's LAuReL and per-layer-input projections read 8 features: no group of 32 fits."""
    out = tmp_path / "g.pte"
    args = ["export", str(tiny_checkpoint("gemma3n")), "-o", str(out), "--max-step", "16", "--no-progress",
            "--quantize", "q4", "--group-size", "32"]  # fmt: skip
    assert main(args) == 0
    stdout = capsys.readouterr().out
    kept = stdout.split("kept at full precision (")[1].splitlines()[1:]
    assert kept and all("columns do not divide into groups of 32" in line for line in kept)
    assert any("laurel" in line for line in kept)


def test_a_quantized_type_this_machine_cannot_run_is_refused_at_load(quantized_pte, capsys, monkeypatch):
    import mlx_pte.interpreter.quantized_kernels as kernels

    out, args = quantized_pte
    if not out.exists():
        assert main(args) == 0

    def no_kernel(*args, **kwargs):
        raise RuntimeError("[quantized_matmul] no kernel for this mode on this device")

    monkeypatch.setattr(kernels.mx, "quantized_matmul", no_kernel)
    monkeypatch.setattr(kernels, "_CHECKED", set())
    capsys.readouterr()
    assert main(["run", str(out), "--prompt", "The for statement", "--max-new-tokens", "2"]) == 1
    assert "cannot run affine 4-bit, groups of 32 weights" in one_error_line(capsys.readouterr())
