"""Safetensors files, read and checked without the `safetensors` package.

The format is small: an 8-byte little-endian header length `N`, `N` bytes of
JSON (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}`), then the tensors' bytes, offsets relative to the end of the header.

`read_header` checks a file completely from its header and its size before a
single tensor byte is read: a truncated file, a corrupt header, an unknown
dtype, offsets outside the data or a byte count that does not match the shape
each give one `ValueError` naming the file and the tensor. `open_tensors`
then returns lazy `Tensor`s (shape and dtype now, bytes on `np.asarray`), so
a loader holds one tensor's bytes at a time, never the whole file. bfloat16
comes through `ml_dtypes` (NumPy has no bfloat16 of its own).
"""

from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np

# safetensors dtype names -> NumPy dtypes.
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the safetensors package's own limit


class TensorInfo:
  """One tensor's entry in a header: `dtype`, `shape`, byte range in the data."""

  __slots__ = ("dtype", "shape", "begin", "end")

  def __init__(self, dtype: np.dtype, shape: tuple[int, ...], begin: int, end: int):
    self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end


def read_header(path) -> tuple[dict[str, TensorInfo], int]:
  """Reads and checks a safetensors file's header against the file's size.

  Args:
    path: the file.

  Returns:
    `({name: TensorInfo}, data_start)`: the tensors, and the byte offset of
    the data in the file.

  Raises:
    FileNotFoundError: if `path` is not a file.
    ValueError: naming the file (and the tensor) if it is truncated or its
      header is corrupt: too short for a header, a header length past the
      end of the file, not JSON, an entry without a known dtype, a shape or
      offsets, a byte count that is not `prod(shape) * itemsize`, or a tensor
      that ends past the end of the file.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{str(path)!r} not found")
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter "
                       "than the 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
      raise ValueError(f"{path}: not a safetensors file or truncated (header "
                       f"length {n} bytes, file {size} bytes)")
    raw = f.read(n)
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
  data_start, data_size = 8 + n, size - 8 - n
  out = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    out[name] = _entry(path, name, entry, data_size)
  return out, data_start


def _entry(path, name: str, entry, data_size: int) -> TensorInfo:
  where = f"{path}: tensor {name!r}"
  if not isinstance(entry, dict):
    raise ValueError(f"{where}: corrupt header entry {entry!r}")
  dtype = DTYPES.get(entry.get("dtype"))
  if dtype is None:
    raise ValueError(f"{where}: unsupported dtype {entry.get('dtype')!r} "
                     f"(supported: {', '.join(DTYPES)})")
  shape, offsets = entry.get("shape"), entry.get("data_offsets")
  if not (isinstance(shape, list) and all(
      isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
    raise ValueError(f"{where}: corrupt shape {shape!r}")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(
      isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
          and offsets[0] <= offsets[1]):
    raise ValueError(f"{where}: corrupt data_offsets {offsets!r}")
  begin, end = offsets
  want = int(np.prod(shape, dtype=object)) * dtype.itemsize
  if end - begin != want:
    raise ValueError(f"{where}: holds {end - begin} bytes, but shape "
                     f"{tuple(shape)} of {entry['dtype']} needs {want}")
  if end > data_size:
    raise ValueError(f"{where}: truncated file (the tensor ends at byte {end} "
                     f"of the data, the file holds {data_size})")
  return TensorInfo(dtype, tuple(shape), begin, end)


class Tensor:
  """A tensor in a safetensors file: its shape and dtype now, its bytes when
  `np.asarray` asks for them (read then, straight into a fresh array, and
  not kept: converting twice reads twice).

  Attributes:
    shape, dtype: as in the header.
    path: the file.
  """

  def __init__(self, path: pathlib.Path, info: TensorInfo, data_start: int):
    self.path, self.shape, self.dtype = path, info.shape, info.dtype
    self._offset, self._nbytes = data_start + info.begin, info.end - info.begin

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return self._nbytes

  def __array__(self, dtype=None, copy=None):
    del copy  # always a fresh array
    out = np.empty(self.shape, self.dtype)
    with open(self.path, "rb") as f:
      f.seek(self._offset)
      got = f.readinto(out.reshape(-1).view(np.uint8)) if self._nbytes else 0
    if got != self._nbytes:
      raise ValueError(f"{self.path}: truncated while reading ({got} of "
                       f"{self._nbytes} bytes of a tensor)")
    return out if dtype is None else out.astype(dtype)

  def __repr__(self):
    return f"Tensor({self.path.name}, {self.dtype}{list(self.shape)})"


def open_tensors(path, header: dict[str, TensorInfo] | None = None,
                 data_start: int | None = None) -> dict[str, Tensor]:
  """Every tensor of a file, read lazily (`Tensor`).

  Args:
    path: the file.
    header, data_start: `read_header(path)`'s result, if already read.

  Returns:
    `{name: Tensor}`: shapes and dtypes now, bytes on `np.asarray`, so a
    loader that converts one tensor at a time holds one tensor's bytes at a
    time (no mapping of the whole file stays resident).

  Raises:
    As `read_header`.
  """
  path = pathlib.Path(path)
  if header is None:
    header, data_start = read_header(path)
  return {name: Tensor(path, t, data_start) for name, t in header.items()}


def save(tensors: dict[str, np.ndarray], path, metadata: dict[str, str] | None = None):
  """Writes `tensors` (NumPy arrays, bfloat16 included) as a safetensors file."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
    arrays.append(a)
  if metadata:
    header["__metadata__"] = metadata
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data 8-byte aligned, as safetensors does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for a in arrays:
      f.write(a.tobytes())
