"""The GGUF reader: agreement with gguf-py, every value type, and corrupt input.

Corrupt, truncated or foreign files must always end in ``GGUFError`` naming the
file — never an IndexError, struct.error, RecursionError or the like.
"""

from __future__ import annotations

import functools
import itertools
import struct
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import GGUFError, UnsupportedModelError
from ember.models.architectures import model_config
from ember.models.gguf import GGUFFile
from ember.models.quant import dequantize

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


# ----------------------------------------------------------------- helpers
def _write(path: Path, build, arch: str = "llama") -> Path:
    """Write a GGUF with ``build(writer)`` adding keys and tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _small_tensors(w: gguf.GGUFWriter) -> None:
    rng = np.random.default_rng(0)
    w.add_tensor("t.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("t.f16", rng.standard_normal((2, 8)).astype(np.float16))
    w.add_tensor("t.i32", np.arange(5, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), QT.Q8_0)
    w.add_tensor("t.q8_0", q8, raw_dtype=QT.Q8_0)


def _small_build(w: gguf.GGUFWriter) -> None:
    w.add_string("general.name", "fuzz")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "déf", ""])
    w.add_key_value("tokenizer.ggml.token_type", [1, 2, 3, 1], VT.ARRAY, sub_type=VT.INT32)
    w.add_array("nested", [[1, 2], [3]])
    _small_tensors(w)


@functools.cache
def _small_gguf() -> bytes:
    """A small valid GGUF (metadata of several kinds, four tensors), as bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        return _write(Path(tmp) / "small.gguf", _small_build).read_bytes()


@functools.cache
def _small_layout() -> tuple[int, int]:
    """(start of tensor data, end of the last tensor's bytes) in ``_small_gguf()``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "small.gguf"
        path.write_bytes(_small_gguf())
        with GGUFFile(path) as f:
            return f.data_offset, max(t.offset + t.nbytes for t in f.tensors.values())


def _read_fully(path: Path) -> None:
    """Open ``path`` and touch every tensor's bytes (what a loader would do)."""
    with GGUFFile(path) as f:
        for info in f.tensors.values():
            assert f.tensor_bytes(info.name).size == info.nbytes


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-fuzz")


_names = itertools.count()


def _scratch(dir_: Path, data: bytes) -> Path:
    path = dir_ / f"case{next(_names)}.gguf"
    path.write_bytes(data)
    return path


# ------------------------------------------------------ against gguf-py (real file)
@pytest.fixture(scope="module")
def reference_reader(smollm2_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf)  # slow: a numpy view per vocabulary entry


def _as_plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_as_plain(v) for v in value]
    return value


@pytest.mark.slow
def test_metadata_matches_gguf_py(smollm2_file: GGUFFile, reference_reader) -> None:
    ref = {k: f for k, f in reference_reader.fields.items() if not k.startswith("GGUF.")}
    assert set(smollm2_file.metadata) == set(ref)
    for key, field in ref.items():
        ours = smollm2_file.metadata[key]
        assert _as_plain(ours) == field.contents(), key
        if field.types[0] == VT.ARRAY and field.types[-1] != VT.STRING:
            assert isinstance(ours, np.ndarray), key
    assert smollm2_file.version == reference_reader.fields["GGUF.version"].contents()
    assert len(smollm2_file.tensors) == reference_reader.fields["GGUF.tensor_count"].contents()
    tokens = smollm2_file.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(isinstance(t, str) for t in tokens[:100])


@pytest.mark.slow
def test_tensor_directory_and_bytes_match_gguf_py(
    smollm2_file: GGUFFile, reference_reader
) -> None:
    ref = {t.name: t for t in reference_reader.tensors}
    assert list(smollm2_file.tensors) == [t.name for t in reference_reader.tensors]
    for name, t in ref.items():
        info = smollm2_file.tensors[name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)), name
        assert info.ggml_type == int(t.tensor_type), name
        assert info.n_elements == int(t.n_elements), name
        assert info.nbytes == int(t.n_bytes), name
        assert info.offset == int(t.data_offset), name
    sample = ["token_embd.weight", "output_norm.weight"] + [
        n for n in ref if n.startswith(("blk.0.", "blk.29."))
    ]
    types = set()
    for name in sample:
        ours = smollm2_file.tensor_bytes(name)
        theirs = np.asarray(ref[name].data).reshape(-1).view(np.uint8)
        assert ours.tobytes() == theirs.tobytes(), name
        types.add(smollm2_file.tensors[name].type_name)
    assert {"Q4_1", "F32"} <= types


# ------------------------------------------------------------ every value type
SCALARS = {
    "v.u8": (VT.UINT8, 255),
    "v.i8": (VT.INT8, -128),
    "v.u16": (VT.UINT16, 65535),
    "v.i16": (VT.INT16, -32768),
    "v.u32": (VT.UINT32, 2**32 - 1),
    "v.i32": (VT.INT32, -(2**31)),
    "v.f32": (VT.FLOAT32, 0.1),
    "v.bool_t": (VT.BOOL, True),
    "v.bool_f": (VT.BOOL, False),
    "v.str": (VT.STRING, "héllo ✓ 世界"),
    "v.str_empty": (VT.STRING, ""),
    "v.u64": (VT.UINT64, 2**64 - 1),
    "v.i64": (VT.INT64, -(2**63)),
    "v.f64": (VT.FLOAT64, 0.1),
}
ARRAYS = {
    "a.u8": (VT.UINT8, [0, 1, 255], np.uint8),
    "a.i8": (VT.INT8, [-128, 0, 127], np.int8),
    "a.u16": (VT.UINT16, [0, 65535], np.uint16),
    "a.i16": (VT.INT16, [-32768, 32767], np.int16),
    "a.u32": (VT.UINT32, [0, 2**32 - 1], np.uint32),
    "a.i32": (VT.INT32, [-(2**31), 2**31 - 1], np.int32),
    "a.f32": (VT.FLOAT32, [0.5, -1.25, 1e30], np.float32),
    "a.bool": (VT.BOOL, [True, False, True], np.bool_),
    "a.u64": (VT.UINT64, [0, 2**64 - 1], np.uint64),
    "a.i64": (VT.INT64, [-(2**63), 2**63 - 1], np.int64),
    "a.f64": (VT.FLOAT64, [0.1, -2.5e300], np.float64),
}


def _all_types_build(w: gguf.GGUFWriter) -> None:
    for key, (vtype, value) in SCALARS.items():
        w.add_key_value(key, value, vtype)
    for key, (vtype, values, _) in ARRAYS.items():
        w.add_key_value(key, values, VT.ARRAY, sub_type=vtype)
    w.add_array("a.str", ["x", "", "ünï", "a b"])
    w.add_array("a.nested", [[1, 2, 3], [4], [5, 6]])
    w.add_custom_alignment(64)
    _small_tensors(w)


@pytest.mark.parametrize("version", [3, 2])
def test_every_value_type_reads_back(tmp_path: Path, version: int) -> None:
    path = _write(tmp_path / "all.gguf", _all_types_build)
    data = bytearray(path.read_bytes())
    assert struct.unpack_from("<I", data, 4)[0] == 3  # GGUFWriter writes v3
    struct.pack_into("<I", data, 4, version)  # v2 has the same layout
    path.write_bytes(bytes(data))

    with GGUFFile(path) as f:
        assert f.version == version
        md = f.metadata
        assert md["general.architecture"] == "llama"
        for key, (vtype, value) in SCALARS.items():
            if vtype == VT.FLOAT32:
                assert md[key] == float(np.float32(value)), key
            else:
                assert md[key] == value and type(md[key]) is type(value), key
        for key, (_, values, dtype) in ARRAYS.items():
            assert isinstance(md[key], np.ndarray) and md[key].dtype == dtype, key
            np.testing.assert_array_equal(md[key], np.array(values, dtype=dtype), err_msg=key)
        assert md["a.str"] == ["x", "", "ünï", "a b"]
        assert [a.tolist() for a in md["a.nested"]] == [[1, 2, 3], [4], [5, 6]]

        # Tensors: torch-order shapes, types, and the exact bytes written.
        assert md["general.alignment"] == 64
        assert f.data_offset % 64 == 0
        assert {n: (t.shape, t.type_name) for n, t in f.tensors.items()} == {
            "t.f32": ((3, 4), "F32"),
            "t.f16": ((2, 8), "F16"),
            "t.i32": ((5,), "I32"),
            "t.q8_0": ((2, 64), "Q8_0"),
        }
        for info in f.tensors.values():
            assert (info.offset - f.data_offset) % 64 == 0
        np.testing.assert_array_equal(
            f.tensor_bytes("t.f32").view(np.float32), np.arange(12, dtype=np.float32)
        )
        assert f.tensor("t.q8_0").nbytes == 2 * 2 * 34
        with pytest.raises(GGUFError, match="missing tensor 'nope'"):
            f.tensor("nope")
        with pytest.raises(GGUFError, match="missing metadata key 'nope'"):
            f.require("nope")


@pytest.mark.parametrize("version", [1, 4, 0xFFFFFFFF])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    data = bytearray(_small_gguf())
    struct.pack_into("<I", data, 4, version)
    path = _scratch(tmp_path, bytes(data))
    with pytest.raises(GGUFError, match=f"unsupported GGUF version {version}") as exc:
        GGUFFile(path)
    assert str(path) in str(exc.value)


# ------------------------------------------------------------------ bad files
def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(GGUFError, match="not found") as exc:
        GGUFFile(path)
    assert str(path) in str(exc.value)


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="not found"):
        GGUFFile(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    path = _scratch(tmp_path, b"")
    with pytest.raises(GGUFError) as exc:
        GGUFFile(path)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize(
    "data",
    [b"GGU", b"PK\x03\x04" + bytes(60), b"\x00" * 64, b"ggml" + bytes(60), b"{\"a\": 1}\n"],
    ids=["short", "zip", "zeros", "ggml", "json"],
)
def test_not_a_gguf(tmp_path: Path, data: bytes) -> None:
    path = _scratch(tmp_path, data)
    with pytest.raises(GGUFError) as exc:
        GGUFFile(path)
    assert str(path) in str(exc.value)
    if len(data) >= 4:
        assert "not a GGUF file" in str(exc.value)


def _cut_points() -> dict[str, int]:
    data = _small_gguf()
    data_start, data_end = _small_layout()
    first_key = data.index(b"general.architecture")
    tokens = data.index(b"tokenizer.ggml.tokens")
    first_tensor = data.index(b"t.f32")
    q8_info = data.index(b"t.q8_0")
    return {
        "in-magic": 2,
        "in-version": 6,
        "in-tensor-count": 12,
        "in-kv-count": 20,
        "in-first-key-length": 26,
        "in-first-key": first_key + 5,
        "in-string-array": tokens + 40,
        "in-tensor-name": first_tensor + 2,
        "in-tensor-dims": first_tensor + 5 + 6,
        "in-tensor-offset": q8_info + 6 + 4 + 16 + 4 + 3,
        "at-data-start": data_start,
        "in-first-tensor": data_start + 10,
        "in-last-tensor": data_end - 10,
    }


@pytest.mark.parametrize("where", list(_cut_points()))
def test_truncated_file(tmp_path: Path, where: str) -> None:
    cut = _cut_points()[where]
    path = _scratch(tmp_path, _small_gguf()[:cut])
    with pytest.raises(GGUFError) as exc:
        _read_fully(path)
    assert str(path) in str(exc.value)
    assert "truncated" in str(exc.value) or "not a GGUF" in str(exc.value)


@settings(max_examples=150, deadline=None)
@given(cut=st.integers(min_value=0, max_value=len(_small_gguf())))
def test_any_truncation_is_a_gguf_error(fuzz_dir: Path, cut: int) -> None:
    data = _small_gguf()
    _, data_end = _small_layout()
    path = _scratch(fuzz_dir, data[:cut])
    try:
        if cut < data_end:
            with pytest.raises(GGUFError) as exc:
                _read_fully(path)
            assert str(path) in str(exc.value)
        else:  # only trailing padding is missing: every tensor is intact
            _read_fully(path)
    finally:
        path.unlink()


@settings(max_examples=300, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 2**16), st.integers(1, 255)),
                      min_size=1, max_size=4))
def test_corrupt_header_is_a_gguf_error_or_reads(
    fuzz_dir: Path, flips: list[tuple[int, int]]
) -> None:
    data = bytearray(_small_gguf())
    header_len, _ = _small_layout()
    for pos, mask in flips:
        data[pos % header_len] ^= mask
    path = _scratch(fuzz_dir, bytes(data))
    try:
        _read_fully(path)
    except GGUFError as e:
        assert str(path) in str(e)
    finally:
        path.unlink()


def _header_only(*items: bytes, n_tensors: int = 0, n_kv: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + b"".join(items)


def _key(name: str) -> bytes:
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    "data, message",
    [
        (_header_only(_key("k") + struct.pack("<I", 13)), "unknown metadata value type 13"),
        (_header_only(_key("k") + struct.pack("<IIQ", 9, 42, 1)), "unknown array item type 42"),
        # arrays of arrays of arrays ... : bounded nesting, not a RecursionError
        (_header_only(_key("k") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000),
         "nested too deep"),
        (_header_only(_key("k") + struct.pack("<IIQ", 9, 4, 2**62)), "truncated"),
        (_header_only(_key("k") + struct.pack("<IIQ", 9, 8, 2**40)), "truncated"),
        (_header_only(struct.pack("<Q", 2**63)), "truncated"),
        (_header_only(n_kv=2**64 - 1), "truncated"),
        (_header_only(_key("general.alignment") + struct.pack("<II", 4, 0)),
         "invalid general.alignment 0"),
        (_header_only(_key("general.alignment") + struct.pack("<I", 8) + _key("x")),
         "invalid general.alignment 'x'"),
        (_header_only(_key("t") + struct.pack("<I", 9), n_tensors=1, n_kv=0),
         "tensor 't' has 9 dims"),
        (_header_only(_key("t") + struct.pack("<IQIQ", 1, 4, 99, 0), n_tensors=1, n_kv=0),
         "tensor 't' has unknown ggml type 99"),
        (_header_only(_key("t") + struct.pack("<IQIQ", 1, 4, 8, 0), n_tensors=1, n_kv=0),
         "row length 4 is not a multiple of the Q8_0 block size 32"),
        (_header_only(_key("t") + struct.pack("<IQQIQ", 2, 2**30, 2**30, 0, 0), n_tensors=1,
                      n_kv=0), "truncated file: tensor 't'"),
        (_header_only(_key("t") + struct.pack("<IQQIQ", 2, 0, 2**40, 0, 0), n_tensors=1,
                      n_kv=0), "tensor 't' has a dimension above"),
    ],
    ids=["value-type", "array-item-type", "deep-nesting", "huge-array", "huge-string-array",
         "huge-key", "huge-kv-count", "zero-alignment", "string-alignment", "too-many-dims",
         "unknown-tensor-type", "partial-block", "huge-tensor",
         "huge-side"],
)
def test_malformed_header(tmp_path: Path, data: bytes, message: str) -> None:
    path = _scratch(tmp_path, data)
    with pytest.raises(GGUFError, match=message) as exc:
        GGUFFile(path)
    assert str(path) in str(exc.value)


# ------------------------------------------------------- unsupported content
def test_unsupported_architecture(tmp_path: Path) -> None:
    def build(w: gguf.GGUFWriter) -> None:
        w.add_block_count(2)
        w.add_embedding_length(64)
        w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))

    path = _write(tmp_path / "mamba.gguf", build, arch="mamba")
    with GGUFFile(path) as f:
        assert f.architecture == "mamba"
        with pytest.raises(UnsupportedModelError, match="'mamba'") as exc:
            model_config(f)
    assert "mamba.gguf" in str(exc.value) and "llama" in str(exc.value)


def test_missing_architecture_key(tmp_path: Path) -> None:
    data = _small_gguf().replace(b"general.architecture", b"general.architecturX")
    with GGUFFile(_scratch(tmp_path, data)) as f, pytest.raises(
        GGUFError, match="missing metadata key 'general.architecture'"
    ):
        model_config(f)


def test_iq_tensor_opens_but_does_not_dequantize(tmp_path: Path) -> None:
    """A named type ember cannot compute (IQ2_XXS) is listed, then rejected by name."""

    def build(w: gguf.GGUFWriter) -> None:
        # raw bytes: 2 rows of one 66-byte block = 2 x 256 elements
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 66), dtype=np.uint8),
                     raw_dtype=QT.IQ2_XXS)

    path = _write(tmp_path / "iq.gguf", build)
    with GGUFFile(path) as f:
        info = f.tensor("blk.0.ffn_up.weight")
        assert (info.shape, info.type_name, info.nbytes) == ((2, 256), "IQ2_XXS", 132)
        with pytest.raises(UnsupportedModelError, match="IQ2_XXS") as exc:
            dequantize(f.tensor_bytes(info.name), info.ggml_type, info.shape, name=info.name)
    assert "blk.0.ffn_up.weight" in str(exc.value)


def test_dequantize_unknown_type_number() -> None:
    with pytest.raises(UnsupportedModelError, match="type#99"):
        dequantize(np.zeros(16, dtype=np.uint8), 99, (4,))


def test_load_model_names_an_unsupported_tensor_type(tmp_path: Path, smollm2_file) -> None:
    """A model whose matrices are IQ2_XXS (no dequantizer) is refused at load, the type
    and a tensor named — never mid-generation."""
    import gguf as gguf_py
    from tiny_model import write_tiny_llama

    from ember.models.loader import load_model

    path = write_tiny_llama(tmp_path / "iq2.gguf", smollm2_file, hidden=256, ffn=256,
                            qtype=gguf_py.GGMLQuantizationType.IQ2_XXS)
    with GGUFFile(path) as f:
        assert f.tensor("blk.1.ffn_down.weight").type_name == "IQ2_XXS"
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS") as exc:
        load_model(str(path))
    assert ".weight" in str(exc.value)  # the tensor is named


# ------------------------------------------------------------------ split models
@pytest.fixture(scope="module")
def split_and_whole(tmp_path_factory: pytest.TempPathFactory, smollm2_file: GGUFFile
                    ) -> tuple[Path, Path]:
    """The tiny Qwen3-MoE twice from one seed: whole, and split into parts of 12 tensors
    by gguf-py's writer (llama.cpp's own, as its converter's --split-max-tensors)."""
    from ember.bench.moe_model import write_moe_gguf

    root = tmp_path_factory.mktemp("split")
    options = dict(n_layers=3, n_experts=8, n_used=2, hidden=64, expert_ffn=128, seed=4)
    whole = write_moe_gguf(root / "whole.gguf", smollm2_file, **options)
    (root / "parts").mkdir()
    first = write_moe_gguf(root / "parts" / "moe.gguf", smollm2_file, split_max_tensors=12,
                           **options)
    return whole, first


def test_a_split_model_reads_as_its_whole_file(split_and_whole) -> None:
    whole, first = split_and_whole
    a, b = GGUFFile(whole), GGUFFile(first)
    assert first.name == "moe-00001-of-00004.gguf" and len(b.parts) == 4
    assert {t.part for t in b.tensors.values()} == {0, 1, 2, 3}
    assert {k: v for k, v in b.metadata.items() if not k.startswith("split.")}.keys() == \
        a.metadata.keys()
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert np.array_equal(a.tensor_bytes(name), b.tensor_bytes(name)), name


@pytest.mark.parametrize("weights, stream", [("f32", False), ("q4", False), ("q4", True)])
def test_a_split_model_computes_what_its_whole_file_does(split_and_whole, weights: str,
                                                         stream: bool) -> None:
    """Resident, and with experts streamed from whichever part holds them."""
    import torch

    from ember.models.loader import load_model
    from ember.models.moe import MoEOptions

    whole, first = split_and_whole
    ids = list(range(5, 300, 5))
    want = load_model(str(whole), weights).model.score(ids)
    split = load_model(str(first), weights, MoEOptions(stream=stream, cache_bytes=1))
    assert torch.equal(split.model.score(ids), want)
    if stream:
        parts = {info.part for s in split.model.experts.layers
                 for info in (s.gate, s.up, s.down)}
        assert len(parts) > 1  # experts read from more than one file
        split.model.experts.close()


def test_a_split_models_missing_part_or_later_part_is_refused_by_name(
        split_and_whole, tmp_path: Path) -> None:
    import shutil

    _, first = split_and_whole
    copy = tmp_path / "parts"
    shutil.copytree(first.parent, copy)
    with pytest.raises(GGUFError, match="name its first part, moe-00001-of-00004.gguf"):
        GGUFFile(copy / "moe-00002-of-00004.gguf")
    (copy / "moe-00003-of-00004.gguf").unlink()
    with pytest.raises(GGUFError, match=r"part 3 of 4 \(moe-00003-of-00004.gguf\) is missing"):
        GGUFFile(copy / "moe-00001-of-00004.gguf")
    shutil.copy(copy / "moe-00004-of-00004.gguf", copy / "moe-00003-of-00004.gguf")
    with pytest.raises(GGUFError, match="not part 3 of 4"):
        GGUFFile(copy / "moe-00001-of-00004.gguf")


def test_a_split_models_fingerprint_covers_every_part(split_and_whole, tmp_path: Path) -> None:
    import shutil

    from ember.models.loader import load_model

    _, first = split_and_whole
    copy = tmp_path / "parts"
    shutil.copytree(first.parent, copy)
    loaded = load_model(str(copy / first.name), "f32")
    before = loaded.fingerprint()
    last = copy / "moe-00004-of-00004.gguf"
    data = bytearray(last.read_bytes())
    data[-10] ^= 0xFF  # a weight of the last part, not the first file's bytes
    last.write_bytes(bytes(data))
    assert loaded.fingerprint() != before


@pytest.mark.parametrize("tensor", ["output_norm.weight", "blk.1.attn_norm.weight"])
def test_a_model_whose_norm_holds_a_nan_is_refused_naming_it(tiny_gguf, tmp_path,
                                                              tensor: str) -> None:
    """A NaN in a norm's weights would make every logit of every request NaN: the load
    refuses the file, naming the tensor."""
    from ember.models.loader import load_model

    with GGUFFile(tiny_gguf) as g:
        info = g.tensors[tensor]
        assert info.type_name == "F32"
    data = bytearray(tiny_gguf.read_bytes())
    data[info.offset + 4:info.offset + 8] = np.float32("nan").tobytes()
    bad = tmp_path / "nan-norm.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=f"'{tensor}' holds non-finite values"):
        load_model(str(bad), "f32")
