"""Read and write GGUF files: metadata, tensor directory, and tensor bytes.

We parse the format ourselves instead of using ``gguf.GGUFReader``: that reader
builds a numpy view per array element, which costs seconds for a 49k-token
vocabulary. Here a string array is decoded in one pass over the mapped bytes, and
tensor data is never copied until a weight format asks for it.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count,
u64 metadata count, the metadata key/values, the tensor infos (name, dims, type,
offset), padding to ``general.alignment``, then the tensor data.

Split models (``llama-gguf-split``: ``NAME-00001-of-0000N.gguf``, as large models ship)
are opened by naming their first part, as llama.cpp does: its ``split.count`` says how
many parts there are, each part is a GGUF of its own holding some of the tensors (the
first also every metadata key), and the parts lie beside it under the same name with
their own numbers. ``GGUFFile`` reads them as one file: a tensor's ``part`` says whose
bytes it is.

``write_gguf`` writes that layout (v3) for generated models: it takes the tensor
directory up front and each tensor's bytes as chunks when its turn comes, so a
multi-gigabyte file is never held in memory. It writes what ``GGUFFile`` reads (and
``gguf.GGUFReader``, the reference, in ``tests/test_bench_synth.py``).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ember.errors import GGUFError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_NESTING = 8  # arrays of arrays deeper than this are corrupt, not data
MAX_DIM = (1 << 31) - 1  # the longest side of a tensor ember reads


class GGMLType(IntEnum):
    """Tensor element types (the subset of ggml's numbering that appears in files)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# (elements per block, bytes per block) for every named type, so a file holding a
# type ember cannot compute with still opens and the loader can name that type.
BLOCK_GEOMETRY: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.F64: (1, 8),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
}


class _ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FORMATS = {
    _ValueType.UINT8: ("<B", np.uint8),
    _ValueType.INT8: ("<b", np.int8),
    _ValueType.UINT16: ("<H", np.uint16),
    _ValueType.INT16: ("<h", np.int16),
    _ValueType.UINT32: ("<I", np.uint32),
    _ValueType.INT32: ("<i", np.int32),
    _ValueType.FLOAT32: ("<f", np.float32),
    _ValueType.BOOL: ("<?", np.bool_),
    _ValueType.UINT64: ("<Q", np.uint64),
    _ValueType.INT64: ("<q", np.int64),
    _ValueType.FLOAT64: ("<d", np.float64),
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory.

    ``shape`` is in PyTorch order (outermost first), i.e. GGUF's ``ne`` reversed:
    a GGUF matrix with ne = [in_features, out_features] has shape (out, in).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute offset of the first byte in its part's file
    nbytes: int
    part: int = 0  # which file of a split model holds it (0: the first, or the only one)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        try:
            return GGMLType(self.ggml_type).name
        except ValueError:
            return f"type#{self.ggml_type}"


class _Cursor:
    """Sequential little-endian reader over a buffer, raising GGUFError on overrun."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated GGUF header (needed {n} bytes at {self.pos})")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def string_array(self, count: int) -> list[str]:
        out: list[str] = []
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self._need(8)
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self._need(n)
            out.append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, depth: int = 0) -> Any:
        try:
            vt = _ValueType(vtype)
        except ValueError:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}") from None
        if vt == _ValueType.STRING:
            return self.string()
        if vt == _ValueType.ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type == _ValueType.STRING:
                return self.string_array(count)
            if item_type == _ValueType.ARRAY:
                if depth >= MAX_ARRAY_NESTING:
                    raise GGUFError(f"{self.path}: metadata arrays nested too deep")
                return [self.value(_ValueType.ARRAY, depth + 1) for _ in range(count)]
            if item_type not in _SCALAR_FORMATS:
                raise GGUFError(f"{self.path}: unknown array item type {item_type}")
            dtype = np.dtype(_SCALAR_FORMATS[_ValueType(item_type)][1]).newbyteorder("<")
            nbytes = count * dtype.itemsize
            self._need(nbytes)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += nbytes
            return arr
        value = self.scalar(_SCALAR_FORMATS[vt][0])
        return bool(value) if vt == _ValueType.BOOL else value


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """Which file, in which state: (device, inode, size, mtime). Whoever reads a model's
    bytes again later checks it is still the file that was parsed."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS = "split.count", "split.no", "split.tensors.count"


def split_part_path(first: Path, no: int, count: int) -> Path:
    """Where part ``no`` (0-based) of a split model whose first part is ``first`` lies:
    llama.cpp's ``PREFIX-%05d-of-%05d.gguf``, numbered from 1."""
    m = SPLIT_NAME.match(first.name)
    if m is None:
        raise GGUFError(f"{first}: a split model's first part is named "
                        f"NAME-00001-of-{count:05d}.gguf")
    return first.with_name(f"{m['prefix']}-{no + 1:05d}-of-{count:05d}.gguf")


class _Part:
    """One mapped file of a (possibly split) model."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise GGUFError(f"model file not found: {path}")
        try:
            with open(path, "rb") as f:
                self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self.identity = file_identity(os.fstat(f.fileno()))
        except (OSError, ValueError) as e:  # ValueError: empty file cannot be mapped
            raise GGUFError(f"{path}: cannot map file ({e})") from None
        first = np.frombuffer(self.mmap, dtype=np.uint8, count=1)
        self.base = first.ctypes.data  # the mapping's address (release_view)
        del first  # a live export would keep close() from unmapping

    def close(self) -> None:
        try:
            self.mmap.close()
        except BufferError:  # arrays from tensor_bytes still reference it
            pass


class GGUFFile:
    """An open GGUF file: ``metadata`` (dict), ``tensors`` (name → TensorInfo), raw bytes.

    The file (every part of a split model) stays memory-mapped for the object's
    lifetime; ``tensor_bytes`` returns zero-copy views into it. ``path`` is the file
    named (a split model's first part); ``parts`` every file's path and identity.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._parts = [_Part(self.path)]
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse(0, self.metadata)
            self._open_other_parts()
        except BaseException:
            self.close()
            raise

    @property
    def identity(self) -> tuple[int, ...]:
        """The first part's (:func:`file_identity`); ``parts`` has every part's."""
        return self._parts[0].identity

    @property
    def parts(self) -> list[tuple[Path, tuple[int, ...]]]:
        """(path, identity) of each file of the model, in part order."""
        return [(p.path, p.identity) for p in self._parts]

    def _open_other_parts(self) -> None:
        """A split model's parts after the first, each checked to be its part of this
        model; every tensor the first part announces must be found once."""
        try:
            count = int(self.metadata.get(SPLIT_COUNT, 1))
            no = int(self.metadata.get(SPLIT_NO, 0))
        except (TypeError, ValueError):
            raise GGUFError(f"{self.path}: {SPLIT_COUNT} / {SPLIT_NO} are not part numbers "
                            f"({self.metadata.get(SPLIT_COUNT)!r}, "
                            f"{self.metadata.get(SPLIT_NO)!r})") from None
        if count <= 1:
            return
        if no != 0:
            first = split_part_path(self.path, 0, count)
            raise GGUFError(f"{self.path} is part {no + 1} of {count} of a split model: "
                            f"name its first part, {first.name}")
        for i in range(1, count):
            part = split_part_path(self.path, i, count)
            if not part.is_file():
                raise GGUFError(f"{self.path.name}: split model part {i + 1} of {count} "
                                f"({part.name}) is missing")
            self._parts.append(_Part(part))
            own: dict[str, Any] = {}
            self._parse(i, own)
            if int(own.get(SPLIT_COUNT, 0)) != count or int(own.get(SPLIT_NO, -1)) != i:
                raise GGUFError(f"{part}: not part {i + 1} of {count} of {self.path.name} "
                                f"(its split.no / split.count say {own.get(SPLIT_NO)} / "
                                f"{own.get(SPLIT_COUNT)})")
        expected = int(self.metadata.get(SPLIT_TENSORS, len(self.tensors)))
        if expected != len(self.tensors):
            raise GGUFError(f"{self.path.name}: the split model announces {expected} "
                            f"tensors, its {count} parts hold {len(self.tensors)}")

    def _parse(self, part: int, metadata: dict[str, Any]) -> None:
        mm, path = self._parts[part].mmap, self._parts[part].path
        cur = _Cursor(mm, path)
        if mm[:4] != GGUF_MAGIC:
            # (nothing of the file in the message: a server may be asked to open any path)
            raise GGUFError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version}")
        if part == 0:
            self.version = version
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))

        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dims")
            ne = [cur.scalar("<Q") for _ in range(n_dims)]
            if any(d > MAX_DIM for d in ne):
                # (no real tensor has a side this long; a bigger one only serves to make
                # size arithmetic overflow, the class of llama.cpp's GGUF CVEs)
                raise GGUFError(f"{self.path}: tensor {name!r} has a dimension above "
                                f"{MAX_DIM}: {ne}")
            ggml_type = cur.scalar("<I")
            rel_offset = cur.scalar("<Q")
            infos.append((name, ne, ggml_type, rel_offset))

        alignment = metadata.get("general.alignment",
                                 self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise GGUFError(f"{path}: invalid general.alignment {alignment!r}")
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        if part == 0:
            self.data_offset = data_start
        for name, ne, ggml_type, rel_offset in infos:
            shape = tuple(int(d) for d in reversed(ne))
            n_el = 1
            for d in shape:
                n_el *= d
            try:
                nbytes = _tensor_nbytes(name, n_el, int(ne[0]) if ne else 1, ggml_type)
            except GGUFError as e:
                raise GGUFError(f"{path}: {e}") from None
            offset = data_start + rel_offset
            if offset + nbytes > len(mm):
                raise GGUFError(
                    f"{path}: truncated file: tensor {name!r} ends at byte "
                    f"{offset + nbytes}, file has {len(mm)}"
                )
            if name in self.tensors:
                raise GGUFError(f"{path}: tensor {name!r} appears twice in the model")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, offset, nbytes, part)

    # ------------------------------------------------------------------ access
    def release_pages(self) -> None:
        """Drop the mapping's pages from this process's resident set.

        After loading, the weights live in their own tensors; the few bytes still read
        from the file later (embedding rows) fault back in from the page cache. Without
        this every page read while loading stays counted in the process's RSS.
        """
        for part in self._parts:
            if hasattr(part.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                part.mmap.madvise(mmap.MADV_DONTNEED)

    def release_view(self, view: np.ndarray) -> None:
        """Drop the whole pages under ``view`` (an array from ``tensor_bytes``/``span``)
        from this process's resident set, once its bytes have been copied elsewhere (a
        weight packed). Arrays that do not lie in this file's mapping are ignored."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        for part in self._parts:
            start = view.ctypes.data - part.base
            end = start + view.nbytes
            if start < 0 or end > len(part.mmap):
                continue
            page = mmap.PAGESIZE
            first, last = -(-start // page) * page, end // page * page
            if last > first:
                part.mmap.madvise(mmap.MADV_DONTNEED, first, last - first)
            return

    def drop_array_metadata(self) -> None:
        """Forget list-valued metadata (vocabulary, scores, merges) once the tokenizer
        and chat template have read it: the model keeps this file open for embedding
        rows, and a 49k-entry vocabulary's strings are ~10 MB for its whole life."""
        for key in [k for k, v in self.metadata.items() if isinstance(v, list)]:
            del self.metadata[key]

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 array (a view of the mapping)."""
        info = self.tensor(name)
        return self.span(info.offset, info.nbytes, info.part)

    def span(self, offset: int, nbytes: int, part: int = 0) -> np.ndarray:
        """``nbytes`` raw bytes at ``offset`` of file ``part`` (a read-only view of the
        mapping)."""
        return np.frombuffer(self._parts[part].mmap, dtype=np.uint8, count=nbytes,
                             offset=offset)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def close(self) -> None:
        """Unmap the file, or, while arrays from ``tensor_bytes`` still reference it,
        leave the mapping to be released when the last of them is garbage-collected."""
        for part in self._parts:
            part.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tensor_nbytes(name: str, n_elements: int, row_len: int, ggml_type: int) -> int:
    try:
        block_elems, block_bytes = BLOCK_GEOMETRY[GGMLType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
    if row_len % block_elems:
        raise GGUFError(
            f"tensor {name!r}: row length {row_len} is not a multiple of the "
            f"{GGMLType(ggml_type).name} block size {block_elems}"
        )
    return n_elements // block_elems * block_bytes


# ------------------------------------------------------------------------ writing

# numpy dtype -> GGUF value type, for typed scalars (np.uint32(5)) and numeric arrays
_DTYPE_VALUE_TYPES: dict[np.dtype, _ValueType] = {
    np.dtype(dt): vt for vt, (_, dt) in _SCALAR_FORMATS.items()
}


@dataclass(frozen=True)
class TensorToWrite:
    """One tensor for ``write_gguf``: its directory entry, and ``chunks``, called once
    when the tensor's turn comes, yielding its raw bytes in order (bytes or arrays)."""

    name: str
    shape: tuple[int, ...]  # PyTorch order, as in TensorInfo
    ggml_type: int
    chunks: Callable[[], Iterable[bytes | np.ndarray]]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return _tensor_nbytes(self.name, n, self.shape[-1] if self.shape else 1, self.ggml_type)


def write_gguf(out: BinaryIO, metadata: Mapping[str, Any],
               tensors: Sequence[TensorToWrite]) -> int:
    """Write a GGUF v3 file to ``out``; returns the number of bytes written.

    Metadata values are typed by what they are: ``str``, ``bool``, ``float`` (FLOAT32),
    ``int`` (UINT32 when it fits, else INT32 / UINT64 / INT64), a numpy scalar (its
    dtype: ``np.int32(-1)``), a list of ``str`` (a string array), or a 1-D numpy array
    (an array of its dtype). Each tensor starts at a multiple of ``general.alignment``
    (default 32); its chunks must add up to exactly its size (else GGUFError), and are
    written as they come, so only one chunk is in memory at a time.
    """
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int | np.integer) \
            or alignment <= 0:
        raise GGUFError(f"invalid general.alignment {alignment!r}")
    alignment = int(alignment)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GGUFError(f"duplicate tensor names: {', '.join(dup)}")

    header = bytearray(GGUF_MAGIC)
    header += struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, value in metadata.items():
        header += _encode_string(key)
        vtype = _value_type(key, value)
        header += struct.pack("<I", vtype)
        header += _encode_value(key, vtype, value)
    offset = 0
    for t in tensors:
        header += _encode_string(t.name)
        header += struct.pack(f"<I{len(t.shape)}Q", len(t.shape), *reversed(t.shape))
        header += struct.pack("<IQ", t.ggml_type, offset)
        offset = _align(offset + t.nbytes, alignment)
    header += bytes(_align(len(header), alignment) - len(header))
    out.write(header)
    written = len(header)

    for t in tensors:
        expected, n = t.nbytes, 0
        for chunk in t.chunks():
            if isinstance(chunk, np.ndarray):
                chunk = np.ascontiguousarray(chunk)
                n += chunk.nbytes
            else:
                n += len(chunk)
            out.write(chunk)
        if n != expected:
            raise GGUFError(f"tensor {t.name!r}: {GGMLType(t.ggml_type).name} shape "
                            f"{t.shape} needs {expected} bytes, its chunks gave {n}")
        pad = _align(n, alignment) - n
        out.write(bytes(pad))
        written += n + pad
    return written


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _encode_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value_type(key: str, value: Any) -> _ValueType:
    if isinstance(value, bool | np.bool_):
        return _ValueType.BOOL
    if isinstance(value, str):
        return _ValueType.STRING
    if isinstance(value, np.generic):
        vt = _DTYPE_VALUE_TYPES.get(value.dtype)
    elif isinstance(value, int):
        for vt, lo, hi in ((_ValueType.UINT32, 0, 1 << 32), (_ValueType.INT32, -(1 << 31), 0),
                           (_ValueType.UINT64, 0, 1 << 64), (_ValueType.INT64, -(1 << 63), 0)):
            if lo <= value < hi:
                return vt
        vt = None
    elif isinstance(value, float):
        return _ValueType.FLOAT32
    elif isinstance(value, np.ndarray | list | tuple):
        return _ValueType.ARRAY
    else:
        vt = None
    if vt is None:
        raise GGUFError(f"metadata {key!r}: cannot write {value!r} ({type(value).__name__})")
    return vt


def _encode_value(key: str, vtype: _ValueType, value: Any) -> bytes:
    if vtype == _ValueType.STRING:
        return _encode_string(value)
    if vtype != _ValueType.ARRAY:
        return struct.pack(_SCALAR_FORMATS[vtype][0], value)
    if isinstance(value, np.ndarray):
        item = _DTYPE_VALUE_TYPES.get(value.dtype.newbyteorder("="))
        if item is None or value.ndim != 1:
            raise GGUFError(f"metadata {key!r}: cannot write a {value.ndim}-D "
                            f"{value.dtype} array (1-D numeric arrays only)")
        le = value.astype(np.dtype(_SCALAR_FORMATS[item][1]).newbyteorder("<"), copy=False)
        return struct.pack("<IQ", item, len(value)) + le.tobytes()
    if not all(isinstance(v, str) for v in value):
        raise GGUFError(f"metadata {key!r}: a list must hold strings; give numbers as a "
                        "1-D numpy array (its dtype is the GGUF item type)")
    return struct.pack("<IQ", _ValueType.STRING, len(value)) + b"".join(
        _encode_string(v) for v in value)
