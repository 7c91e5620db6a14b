"""foveal/loader/gguf_file.py against the gguf package's own GGUFReader: every metadata value and every
tensor's type, shape and bytes the same, on a file with every value type and several tensor types and
on the embedded model; bad files give a GGUFFormatError that says what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from foveal.loader.gguf_file import GGUFFormatError, read_gguf  # noqa: E402


def assert_same_as_gguf_reader(path: str) -> None:
    ref = gguf.GGUFReader(path)
    got = read_gguf(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert got.metadata == want
    assert [type(v) for v in got.metadata.values()] == [type(v) for v in want.values()]
    assert len(got.tensors) == len(ref.tensors)
    for a, b in zip(ref.tensors, got.tensors):
        assert (b.name, b.tensor_type, b.n_bytes) == (a.name, a.tensor_type, int(a.n_bytes))
        assert b.shape == tuple(int(d) for d in a.shape)
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape, a.name
        assert np.array_equal(b.data, a.data), a.name
    assert got.data_offset == ref.data_offset


def write_every_kind(path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü", "<|im_end|>"] * 50)
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for kind in (
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
    ):
        dense = rng.standard_normal((4, 96)).astype(np.float32)
        q = gguf.quants.quantize(dense, kind)
        w.add_tensor(f"q.{kind.name}", q, raw_shape=q.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_matches_gguf_reader(tmp_path, alignment):
    path = tmp_path / "kinds.gguf"
    write_every_kind(path, alignment)
    assert_same_as_gguf_reader(str(path))
    got = read_gguf(str(path))
    assert got.metadata["t.u64"] == 2**63 + 5 and got.metadata["t.str"] == "héllo ✓"
    assert got.data_offset % (alignment or 32) == 0


@pytest.mark.slow
def test_embedded_model_matches_gguf_reader(smollm_path):
    assert_same_as_gguf_reader(smollm_path)


def test_bad_files_say_what_is_wrong(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_every_kind(path)
    data = path.read_bytes()
    cases = {
        b"NOPE" + data[4:]: "magic",
        data[:4] + (7).to_bytes(4, "little") + data[8:]: "version 7",
        data[:4] + (3 << 24).to_bytes(4, "little") + data[8:]: "big-endian",
        data[:200]: "ends",
    }
    for i, (blob, words) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(GGUFFormatError, match=words):
            read_gguf(str(bad))


def test_truncated_tensor_data_is_short_not_an_error_here(tmp_path):
    """The header reads; the loader compares each tensor's bytes with n_bytes and names the cut one."""
    path = tmp_path / "kinds.gguf"
    write_every_kind(path)
    data = path.read_bytes()
    whole = read_gguf(str(path)).tensors[-1]
    cut_at = whole.offset + whole.n_bytes - 10
    (tmp_path / "cut.gguf").write_bytes(data[:cut_at])
    last = read_gguf(str(tmp_path / "cut.gguf")).tensors[-1]
    assert last.data.nbytes == last.n_bytes - 10
