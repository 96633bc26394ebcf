"""The .pte reader against ExecuTorch's own deserializer, on genuine exported files."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.pte import DELEGATE_IDS, delegate_payload, read_pte


def executorch_view(data: bytes) -> tuple[bytes, object]:
    """The MLX delegate's bytes as ExecuTorch reads them, and the extended header."""
    from executorch.exir._serialize._program import _get_extended_header, deserialize_pte_binary

    program = deserialize_pte_binary(data).program  # segments restored inline
    (delegate,) = [d for plan in program.execution_plan for d in plan.delegates if d.id in DELEGATE_IDS]
    return bytes(program.backend_delegate_data[delegate.processed.index].data), _get_extended_header(data)


@pytest.mark.parametrize("kind", ["segment", "inline", "legacy"])
def test_delegate_payload_matches_executorch(pte_files, kind):
    f = pte_files[kind]
    expected, header = executorch_view(f.data)
    found = delegate_payload(f.data)
    assert bytes(found) == expected == f.payload
    # The view is into the file, from the segment area or from inside the program.
    at = np.frombuffer(found, np.uint8).ctypes.data - np.frombuffer(f.data, np.uint8).ctypes.data
    if kind in ("segment", "legacy"):
        assert at >= header.segment_base_offset
    else:
        assert header is None or at + len(found) <= header.program_size


@pytest.mark.parametrize("kind", ["segment", "inline", "legacy"])
def test_read_pte(pte_files, kind):
    f = pte_files[kind]
    p = read_pte(f.path)
    assert p.graph == f.sample.graph
    assert p.manifest == f.sample.manifest
    for slot, array in f.sample.constants.items():
        got = np.frombuffer(p.constant_bytes(slot), array.dtype).reshape(array.shape)
        assert np.array_equal(got, array)


def test_read_pte_names_the_file(tmp_path, pte_files):
    empty = tmp_path / "empty.pte"
    empty.write_bytes(b"")
    with pytest.raises(FormatError, match=f"^{empty}: the file is empty"):
        read_pte(empty)
    short = tmp_path / "short.pte"
    short.write_bytes(pte_files["segment"].data[:-10])
    with pytest.raises(FormatError, match=f"^{short}: .*truncated"):
        read_pte(short)
    with pytest.raises(FileNotFoundError):
        read_pte(tmp_path / "missing.pte")


def test_not_a_program(pte_files):
    with pytest.raises(FormatError, match="not an ExecuTorch program"):
        delegate_payload(pte_files["segment"].payload)  # a payload is not a .pte
    data = bytearray(pte_files["inline"].data)
    data[4:8] = b"ET99"
    with pytest.raises(FormatError, match="format 'ET99' is not supported"):
        delegate_payload(bytes(data))


@pytest.mark.parametrize("kind", ["segment", "inline", "legacy"])
def test_no_mlx_delegate(pte_files, kind):
    data = pte_files[kind].data
    (delegate_id,) = [i for i in DELEGATE_IDS if data.count(i.encode())]
    assert data.count(delegate_id.encode()) == 1  # the delegate's id string
    other = ("CPU" + delegate_id[3:]).encode()
    with pytest.raises(FormatError, match="has 0 MLX delegates"):
        delegate_payload(data.replace(delegate_id.encode(), other))
