"""A Hugging Face safetensors checkpoint read one tensor at a time, straight into the memory that
keeps it: the model's own parameters.

Reading whole files into a dictionary first (safetensors' load_file) holds every weight twice at
the peak of loading, once in the dictionary and once in the model, and memory-mapping them counts
the file's pages against the process while it is open. Here each tensor's bytes go from the file
into its destination with one read (or, where the checkpoint's dtype differs from the model's,
through a bounded staging buffer), so loading peaks at the model's own size.

The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes. Every entry is checked against the file before anything is read,
so a corrupt or truncated file is a ModelLoadError naming it rather than a crash mid-load.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl_backend.errors import ModelLoadError, ModelNotFoundError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# A header larger than this is not a checkpoint's (the format's own reader refuses the same size).
MAX_HEADER_BYTES = 100 << 20
# The staging buffer of a tensor whose dtype is converted on the way in, read a block of rows at a time.
STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, dtype, shape and absolute byte offset."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


class Checkpoint:
    """The tensors of a directory's *.safetensors files, by name (`shapes`); `read_into` copies one
    into a destination tensor of its shape."""

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"{model_dir} has no *.safetensors weights")
        self.entries: dict[str, Entry] = {}
        for f in files:
            for name, entry in _index(f).items():
                if name in self.entries:
                    raise ModelLoadError(f"tensor {name!r} is in both {self.entries[name].file} and {f}")
                self.entries[name] = entry
        self.shapes = {name: e.shape for name, e in self.entries.items()}

    @torch.no_grad()
    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Copy tensor `name` into `dest` (its shape; any dtype and device: converted as torch's copy_
        converts). A contiguous CPU destination of the same dtype is read into directly."""
        e = self.entries[name]
        if tuple(dest.shape) != e.shape:
            want = list(dest.shape)
            raise ValueError(f"{name}: the checkpoint's shape {list(e.shape)}, the model's {want}")
        with open(e.file, "rb") as f:
            f.seek(e.offset)
            if dest.dtype == e.dtype and dest.device.type == "cpu" and dest.is_contiguous():
                _read_exact(f, dest, e.file)
                return
            rows = e.shape[0] if e.shape else 1
            flat = dest.reshape(rows, -1) if dest.is_contiguous() else None
            row_bytes = max(1, math.prod(e.shape[1:]) * e.dtype.itemsize)
            step = max(1, STAGING_BYTES // row_bytes)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                stage = torch.empty((r1 - r0, *e.shape[1:]) if e.shape else (), dtype=e.dtype)
                _read_exact(f, stage, e.file)
                if not e.shape:
                    dest.copy_(stage)
                elif flat is not None:
                    flat[r0:r1].copy_(stage.reshape(r1 - r0, -1))
                else:
                    dest[r0:r1].copy_(stage)


def write(
    path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], tensors: Iterable[torch.Tensor]
) -> None:
    """A safetensors file of the tensors named in `specs` (name -> shape, dtype), taken in that order
    from `tensors` (an iterator: a writer can make each one as it goes, so memory holds one at a
    time). The header comes first, padded so that the data starts 8-byte aligned."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in specs.items():
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, (shape, dtype)), t in zip(specs.items(), tensors, strict=True):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: got {t.dtype} {list(t.shape)}, declared {dtype} {list(shape)}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _read_exact(f, dest: torch.Tensor, path: Path) -> None:
    if not dest.numel():
        return
    view = dest.detach().reshape(-1).view(torch.uint8).numpy().data  # a memoryview of dest's bytes
    while len(view):
        n = f.readinto(view)
        if not n:
            raise ModelLoadError(
                f"cannot read weights file {path}: it ends early (corrupt or truncated safetensors?)"
            )
        view = view[n:]


def _index(path: Path) -> dict[str, Entry]:
    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"cannot read weights file {path}: {why} (corrupt or truncated safetensors?)")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise bad(f"a header of {length} bytes in a file of {size}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise bad(f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    base = 8 + length
    out: dict[str, Entry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise bad(f"entry {name!r} is malformed ({type(err).__name__}: {err})") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes or base + end > size:
            raise bad(f"entry {name!r} ({meta['dtype']} {list(shape)}, bytes {begin}..{end}) does not fit")
        out[name] = Entry(path, dtype, shape, base + begin)
    return out
