"""Our GGUF header reader against gguf's own GGUFReader (the reference), on a file using every value type."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from tandem.core.loading.gguf_header import read_gguf_header
from tandem.core.errors import TandemError


def _reference_value(field):
    types, parts = field.types, field.parts
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(parts[i]).decode() for i in field.data]
        return [parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(parts[-1]).decode()
    return parts[-1].tolist()[0]


@pytest.fixture()
def every_type_gguf(tmp_path):
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 200), w.add_int8("k.i8", -5), w.add_uint16("k.u16", 60000), w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 4_000_000_000), w.add_int32("k.i32", -7), w.add_float32("k.f32", 0.5)
    w.add_uint64("k.u64", 2**40), w.add_int64("k.i64", -(2**40)), w.add_float64("k.f64", 1.25)
    w.add_bool("k.bool", True), w.add_string("k.str", "héllo")
    w.add_array("k.ints", [3, 1, 4, 1, 5]), w.add_array("k.floats", [0.25, -1.5]), w.add_array("k.strs", ["a", "", "ü x"])
    w.add_tensor("w32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("w16", np.arange(6, dtype=np.float16).reshape(2, 3))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_tensors_match_gguf_reader(every_type_gguf):
    ours, ref = read_gguf_header(every_type_gguf), GGUFReader(every_type_gguf)
    assert list(ours.fields) == list(ref.fields)
    for name, field in ref.fields.items():
        expected = _reference_value(field)
        assert ours.fields[name] == pytest.approx(expected) if isinstance(expected, float) else ours.fields[name] == expected, name
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors] == ["w32", "w16"]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.data_offset == b.data_offset and a.n_bytes == b.n_bytes
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)


def test_smollm2_header_matches_gguf_reader(smollm2_path):
    ours, ref = read_gguf_header(smollm2_path), GGUFReader(smollm2_path)
    tokens = ref.fields["tokenizer.ggml.tokens"]
    assert ours.fields["tokenizer.ggml.tokens"] == _reference_value(tokens)
    assert ours.fields["tokenizer.ggml.merges"] == _reference_value(ref.fields["tokenizer.ggml.merges"])
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data.shape) == (b.name, b.tensor_type, b.data.shape)
        assert np.array_equal(a.data[:2].view(np.uint8), np.asarray(b.data[:2]).view(np.uint8))


@pytest.mark.parametrize("cut", [10, 30, 200, -40])
def test_truncated_header_is_one_line_error(every_type_gguf, tmp_path, cut):
    blob = every_type_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(blob[:cut])
    with pytest.raises(TandemError, match="truncated"):
        read_gguf_header(bad)


def test_absurd_array_length_is_an_error_not_a_loop(every_type_gguf, tmp_path):
    blob = bytearray(every_type_gguf.read_bytes())
    at = blob.index(b"k.strs") + len(b"k.strs") + 4 + 4  # key, value type (array), item type -> count
    blob[at:at + 8] = (2**60).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(blob))
    with pytest.raises(TandemError, match="extends past the end"):
        read_gguf_header(bad)
