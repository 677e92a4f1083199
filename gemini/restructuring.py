"""Methods of the wrapped model that change the parameters ``initialize`` laid out, refused before they change
anything.

[Note: methods that restructure the model]
``initialize`` packs every parameter into chunks at fixed offsets, shapes and dtypes. Hugging Face's
``resize_token_embeddings`` assigns a larger tensor to the embedding's ``.data`` and edits ``config.vocab_size``;
``set_input_embeddings`` / ``set_output_embeddings``, ``prune_heads`` and the adapter methods put new modules or
parameters in place. Left to run, such a method half-changes the model and its config, and the next forward or step
fails on parameters no longer in the chunks: the model can be neither used nor saved as it was. So they are refused
up front, with the way to do it: change the model before ``initialize`` (for a trained one, load its checkpoint into
a plain model, change that, and initialize it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RESTRUCTURING", "refusing", "restructuring_refused"]

# transformers' PreTrainedModel (and PEFT's PeftModel for the adapter methods).
RESTRUCTURING = ("resize_token_embeddings", "resize_position_embeddings", "set_input_embeddings",
                 "set_output_embeddings", "prune_heads", "add_adapter", "load_adapter", "delete_adapter")


def restructuring_refused(name: str) -> Any:
    """What ``model.<name>`` (one of RESTRUCTURING) is on gemini's model: a function raising why not."""
    return refusing(name, f"model.{name}() after gemini.initialize is not supported: it replaces or reshapes "
                          f"parameters that gemini laid out in chunks at initialize (nothing was changed). Call it on "
                          f"the model before gemini.initialize (e.g. model.resize_token_embeddings(len(tokenizer)) right "
                          f"after from_pretrained), then initialize. To change a model trained here, load its "
                          f"state_dict() into a plain model, change that and initialize it")


def refusing(name: str, message: str) -> Any:
    """A method named ``name`` that raises ``RuntimeError(message)``, whatever it is given."""
    def refused(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(message)

    refused.__name__ = name
    return refused
