"""Crafted files (any manifest or graph attributes, the payload's CRC recomputed) get one clear
error at load or run correctly: never another exception type, never a hang."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_pte.cli import main
from mlx_pte.interpreter.chat_template import ChatTemplateError
from mlx_pte.serving.generation import GenerationError, generate
from mlx_pte.interpreter.program import Program
from mlx_pte.interpreter.session import Session
from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Instruction, SlotRef
from mlx_pte.ir.payload import decode_payload
from mlx_pte.ir.pte import read_pte
from tests.fixtures.crafted_pte import craft_payload, write_pte
from tests.ir.test_fuzz import time_limit

from tests.fixtures.exported import exported_pte

# A crafted context too short for the prompt is refused by generate, in one line too.
CLEAR = (FormatError, ChatTemplateError, GenerationError)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_checkpoint):
    return read_pte(exported_pte(tmp_path_factory, tiny_checkpoint, "llama"))


def load_and_run(blob: bytes) -> None:
    """What ``mlx-pte run --chat`` does with a file: load, open a session, render, generate."""
    session = Session(Program.from_payload(decode_payload(blob)), "single")
    prompt: list[int] | str = [1, 5, 7]
    if session.manifest.tokenizer and session.manifest.chat_template:
        prompt = TextCodec(session.manifest).render_chat([{"role": "user", "content": "hi"}])
    generate(session, prompt, max_new_tokens=2)


def outcome(blob: bytes) -> str:
    with time_limit(30):  # a hang fails the test
        try:
            load_and_run(blob)
        except CLEAR as exc:
            assert str(exc) and "\n" not in str(exc).strip(), exc
            return "clear"
    return "ran"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
hostile_ints = st.integers(-(2**63), 2**63 - 1) | st.sampled_from([-1, 0, 1, 2, 3, 4, 115, 1441794, 2**31])
attr_values = (
    st.none() | st.booleans() | hostile_ints | st.floats() | st.text(max_size=8)
    | st.builds(SlotRef, st.integers(-2, 80))
    | st.lists(hostile_ints | st.builds(SlotRef, st.integers(-2, 80)), max_size=5).map(tuple)
)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_crafted_graph_attributes(base, data):
    graph = dataclasses.replace(base.graph, instructions=list(base.graph.instructions))
    with_attrs = [i for i, instr in enumerate(graph.instructions) if instr.attrs]
    for _ in range(data.draw(st.integers(1, 3))):
        index = data.draw(st.sampled_from(with_attrs))
        instr = graph.instructions[index]
        name = data.draw(st.sampled_from([k for k, _ in instr.attrs]))
        value = data.draw(attr_values)
        attrs = tuple((k, value if k == name else v) for k, v in instr.attrs)
        graph.instructions[index] = Instruction(instr.op, instr.inputs, instr.outputs, attrs)
    outcome(craft_payload(base, graph=graph))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_crafted_manifests(base, data):
    manifest = json.loads(json.dumps(base.manifest))
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(sorted(manifest) + ["cache.0", "cache.0.window", "cache.1.head_dim"]))
        value = data.draw(json_values | st.sampled_from(["{% if %}", "{{ raise_exception('no') }}", "not json"]))
        if name.startswith("cache.") and isinstance(manifest.get("cache"), list):
            _, i, *field = name.split(".")
            layers = manifest["cache"]
            if int(i) < len(layers) and field and isinstance(layers[int(i)], dict):
                layers[int(i)][field[0]] = value
            elif int(i) < len(layers):
                layers[int(i)] = value
        elif data.draw(st.booleans()):
            manifest[name] = value
        else:
            manifest.pop(name, None)
    outcome(craft_payload(base, manifest=manifest))


def test_the_base_file_runs(base):
    assert outcome(craft_payload(base)) == "ran"


def edit_attr(base, op: str, name: str, value):
    graph = dataclasses.replace(base.graph, instructions=list(base.graph.instructions))
    index = next(i for i, instr in enumerate(graph.instructions) if instr.op == op)
    instr = graph.instructions[index]
    graph.instructions[index] = Instruction(op, instr.inputs, instr.outputs, tuple({**dict(instr.attrs), name: value}.items()))
    return index, craft_payload(base, graph=graph)


# The ops of a fused llama graph (lowering folds its unsqueezes, casts and plain views).
@pytest.mark.parametrize("op, name, value, says", [
    ("rope", "seq_axis", 115, "attribute 'seq_axis' = 115 must be 1"),
    ("rope", "table_scale", float("nan"), "attribute 'table_scale' must be a finite number"),
    ("rope", "table_scale", "big", "attribute 'table_scale' must be float"),
    ("split_heads", "heads", (4, 4, 2, 6, 3), "do not tile"),
    ("split_heads", "head_dim", 0, "head_dim must be >= 1"),
    ("split_heads", "heads", (5, 3, 2, 6, 2), r"must be \[B, 5, T, 16\]"),
    ("permute_view", "dims", (0, 2, 2, 3), "is not a permutation"),
    ("rms_norm", "eps", "tiny", "attribute .eps."),
    ("glu", "width", 10**6, "must be >= 1 and fit twice"),
    ("permute_view", "shape", (1, -1, -1), "more than one -1"),
    ("glu", "activation", "relu6", "must be one of"),
    ("update_and_attend", "cache_id", 9, "names no cache layer"),
    ("index_select", "dim", -1, "axis -1 is outside"),
])  # fmt: skip
def test_impossible_attributes_are_one_format_error_naming_the_instruction(base, op, name, value, says):
    index, blob = edit_attr(base, op, name, value)
    with pytest.raises(FormatError, match=rf"instruction {index} \('{op}'\).*{says}"):
        load_and_run(blob)


@pytest.mark.parametrize("field, value, says", [
    ("tokenizer", "not json {", "tokenizer does not build"),
    ("tokenizer", '{"model": 3}', "tokenizer does not build"),
    ("chat_template", "{% for m in messages %}", "chat template does not compile"),
    ("chat_template", ["x"], "chat_template must be a string"),
    ("max_step", "many", "max_step must be an integer"),
    ("bos_token_id", "one", "bos_token_id must be a token id"),
    ("eos_token_ids", [True], r"eos_token_ids\[0\] must be a token id"),
    ("bos_token_id", 10**6, "bos_token_id must be a token id below"),
    ("pad_token_id", -1, r"pad_token_id must be a token id \(an integer >= 0\)"),
    ("vocab_size", -5, "vocab_size must be an integer >= 1"),
    ("cache", "flat", "cache must be a list"),
    ("dtype", "", "dtype must be one of float32"),
])  # fmt: skip
def test_a_bad_manifest_field_is_one_format_error_at_load(base, field, value, says):
    blob = craft_payload(base, manifest={**base.manifest, field: value})
    with pytest.raises(FormatError, match=says):
        Session(Program.from_payload(decode_payload(blob)), "single")


def test_the_cli_prints_one_line_for_a_crafted_file(base, tmp_path, capsys):
    _, blob = edit_attr(base, "rope", "seq_axis", 115)
    path = write_pte(tmp_path / "crafted.pte", blob)
    assert main(["run", str(path), "--prompt", "hi", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: ") and "'rope'" in err[0], err


def test_chat_with_an_escaping_template_runs_nothing(base, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "pwned.txt"
    template = "{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}" % marker
    path = write_pte(tmp_path / "evil.pte", craft_payload(base, manifest={**base.manifest, "chat_template": template}))
    assert main(["run", str(path), "--chat", "--prompt", "hi", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "chat template" in err[0], err
    assert not marker.exists()


@pytest.mark.parametrize("declared", ["static", "dynamic with a literal size"])
def test_temporaries_past_the_budget_are_refused_at_load_naming_the_instruction(base, declared):
    """A file declaring a 512 MiB temp (its weights are under 1 MiB, so the budget is the
    64 MiB floor) is refused before any weight reaches MLX; a budget given to load admits it."""
    from mlx_pte.ir.graph import SlotKind, SymDim, TensorType

    size = 2**27  # float32: 512 MiB
    graph = dataclasses.replace(base.graph, slots=list(base.graph.slots), instructions=list(base.graph.instructions))
    dim = size if declared == "static" else SymDim("crafted", 1, None)
    slot = graph.add_slot("crafted_temp", SlotKind.TEMP, TensorType("float32", (dim,)))
    graph.instructions.insert(0, Instruction("full", (), (slot,), (("shape", (size,)), ("value", 0.0),
                                                                    ("dtype", "float32"))))
    payload = decode_payload(craft_payload(base, graph=graph))
    with pytest.raises(FormatError, match=r"instruction 0 \('full'\) declares a temporary of 512\.0 MiB.*"
                                          r"past the budget of 64\.0 MiB"):
        Program.from_payload(payload)
    Program.from_payload(payload, temporaries_budget=2**30)
