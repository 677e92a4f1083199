"""The safetensors format's file names and dtypes, shared by the reader and the writer (the file layout: [Note:
writing safetensors a group at a time] in gemini/pretrained/save.py)."""

from __future__ import annotations

import re
import sys

import torch

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# safetensors dtype names (see the format's specification) <-> torch dtypes.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header (MAX_HEADER_SIZE in its Rust crate)

if sys.byteorder != "little":  # the format is little-endian; we copy raw bytes both ways
    raise ImportError("gemini.pretrained reads and writes safetensors' little-endian bytes as they are: "
                      "a big-endian machine is not supported")


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize
