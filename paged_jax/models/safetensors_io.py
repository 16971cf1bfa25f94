"""Safetensors files, read and checked without the `safetensors` package.

The format is small: an 8-byte little-endian header length `N`, `N` bytes of
JSON (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}`), then the tensors' bytes, offsets relative to the end of the header.

`read_header` checks a file completely from its header and its size before a
single tensor byte is read: a truncated file, a corrupt header, an unknown
dtype, offsets outside the data or a byte count that does not match the shape
each give one `ValueError` naming the file and the tensor. `open_tensors`
then maps the file (`mmap`) and returns NumPy views, so a tensor's bytes are
read when it is used and never copied whole into host memory first. bfloat16
comes through `ml_dtypes` (NumPy has no bfloat16 of its own).
"""

from __future__ import annotations

import json
import mmap
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


def open_tensors(path, header: dict[str, TensorInfo] | None = None,
                 data_start: int | None = None) -> dict[str, np.ndarray]:
  """Read-only NumPy views of every tensor in a file, memory-mapped.

  Args:
    path: the file.
    header, data_start: `read_header(path)`'s result, if already read.

  Returns:
    `{name: ndarray}`; the arrays share the file's pages (nothing is read
    until an array is used). They stay valid after the call.

  Raises:
    As `read_header`.
  """
  if header is None:
    header, data_start = read_header(path)
  with open(path, "rb") as f:  # the file holds at least its header: never empty
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  out = {}
  for name, t in header.items():
    count = (t.end - t.begin) // t.dtype.itemsize
    out[name] = np.frombuffer(mm, t.dtype, count, data_start + t.begin).reshape(t.shape)
  return out


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
