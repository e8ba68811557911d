"""Hugging Face transformers models in kiln: build one in a config, write a run's model back out.

A transformers model needs nothing from kiln to train: its class and config class are plain
callables, so a config builds it with nested LazyCalls (random initialisation, no download)::

    from transformers import GPT2Config, GPT2LMHeadModel
    model = L(GPT2LMHeadModel)(config=L(GPT2Config)(n_layer=2, n_embd=64, n_head=4, vocab_size=256))

Weights from a local directory (``save_pretrained`` output: safetensors, sharded or not)::

    model = L(kiln.hf.from_pretrained)(path="/models/tiny-llama", model_class="AutoModelForCausalLM")

At the end of a run, a transformers model is also written in the Hugging Face layout to
``RUN_DIR/hf/`` (:func:`save_hf`), which ``from_pretrained`` loads in one process.

This module is imported only where it is used: ``import kiln`` never imports transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["from_pretrained", "is_hf_model", "save_hf"]

_INSTALL = "pip install 'kiln[hf]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(f"this needs Hugging Face transformers, which is not installed: {_INSTALL}") from None
    return transformers


def from_pretrained(path: str, model_class: str = "AutoModelForCausalLM", **kwargs: Any) -> nn.Module:
    """``transformers.<model_class>.from_pretrained(path)`` from a local directory only (kiln
    never downloads at run time); ``kwargs`` go to ``from_pretrained`` (e.g. ``dtype``)."""
    transformers = _transformers()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"kiln.hf.from_pretrained: {path} is not a directory; give the local directory "
                                "that save_pretrained wrote (config.json and the weights)")
    cls = getattr(transformers, model_class, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"kiln.hf.from_pretrained: transformers has no model class {model_class!r} "
                         "(e.g. AutoModelForCausalLM, AutoModelForMaskedLM, LlamaForCausalLM)")
    return cls.from_pretrained(path, local_files_only=True, **kwargs)


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers
    when it was never imported: then it cannot be one)."""
    import sys

    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def save_hf(model: nn.Module, directory: Path | str, state_dict: dict[str, Any] | None = None) -> Path:
    """Write ``model`` with ``save_pretrained`` (safetensors) to ``directory``; ``state_dict``:
    the whole model's tensors when the model itself holds only shards (FSDP2).

    The tensors are written as copies: in kiln's arena every parameter is a view of one flat
    buffer, which save_pretrained would take for weights tied to each other."""
    directory = Path(directory)
    state = model.state_dict() if state_dict is None else state_dict
    state = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in state.items()}
    logging = _transformers().utils.logging
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # kiln's own progress says where the run is
    try:
        model.save_pretrained(directory, state_dict=state, safe_serialization=True)
    finally:
        if shown:
            logging.enable_progress_bar()
    return directory
