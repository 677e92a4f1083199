"""Weights in and out of chunks, streamed: safetensors files read (or a model initialized) and written one chunk
group at a time.

- ``format``: the safetensors names and dtypes the reader and the writer share
- ``reader``: ``SafetensorsCheckpoint`` (headers checked up front, tensor ranges read on demand), ``WeightsError``
- ``load``: the checkpoint's keys matched to the model, ``prepare_values`` (what ``initialize`` fills the chunks from)
  and ``load_pretrained_into`` (see [Note: a model that never exists whole in RAM] there)
- ``meta_init``: a meta-device model's values from ``reset_parameters()``, ``tie_meta_weights``
- ``save``: ``save_pretrained`` (see [Note: writing safetensors a group at a time] there)
"""

from __future__ import annotations

from gemini.pretrained.load import PreparedValues, load_pretrained_into, prepare_values
from gemini.pretrained.meta_init import tie_meta_weights
from gemini.pretrained.reader import SafetensorsCheckpoint, WeightsError
from gemini.pretrained.save import save_pretrained

__all__ = [
    "PreparedValues",
    "SafetensorsCheckpoint",
    "WeightsError",
    "load_pretrained_into",
    "prepare_values",
    "save_pretrained",
    "tie_meta_weights",
]
