"""Plain PyTorch models behind one registry: ``create_model(name, **kwargs)``.

Models never import parallelism or trainer code; every model exposes its repeated
blocks as ``model.blocks`` (an ``nn.ModuleList``) so activation checkpointing and
pipeline splitting can be applied from outside.
"""

from kiln.models._registry import create_model, example_input, list_models, model_config_class, register_model

# Imported for their @register_model side effect.
from kiln.models import mlp as _mlp  # noqa: F401  isort: skip
from kiln.models import vit as _vit  # noqa: F401  isort: skip
from kiln.models import encoder as _encoder  # noqa: F401  isort: skip
from kiln.models import gpt as _gpt  # noqa: F401  isort: skip
from kiln.models import bert as _bert  # noqa: F401  isort: skip

__all__ = ["create_model", "register_model", "list_models", "model_config_class", "example_input"]
