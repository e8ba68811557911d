"""Plain PyTorch models behind one registry: ``create_model(name, **kwargs)``.

Models never import parallelism or trainer code; every model exposes its repeated
blocks as ``model.blocks`` (an ``nn.ModuleList``) so activation checkpointing and
FSDP can be applied from outside. A family that splits over tensor- or pipeline-parallel
ranks declares how in a :class:`ParallelPlan` registered with it (``kiln/models/_parallel_plan.py``).
"""

from kiln.models._parallel_plan import STYLE_NAMES, ParallelPlan, PipelinePlan, TensorParallelPlan, TPContext
from kiln.models._registry import (
    create_model,
    example_input,
    families_with,
    find_plan,
    list_models,
    model_config_class,
    model_plan,
    models_with,
    register_model,
    register_plan,
    repeated_blocks,
)

# Imported for their @register_model side effect.
from kiln.models import mlp as _mlp  # noqa: F401  isort: skip
from kiln.models import vit as _vit  # noqa: F401  isort: skip
from kiln.models import encoder as _encoder  # noqa: F401  isort: skip
from kiln.models import gpt as _gpt  # noqa: F401  isort: skip
from kiln.models import bert as _bert  # noqa: F401  isort: skip

__all__ = ["create_model", "register_model", "list_models", "model_config_class", "example_input",
           "ParallelPlan", "TensorParallelPlan", "PipelinePlan", "TPContext", "STYLE_NAMES", "register_plan",
           "model_plan", "find_plan", "models_with", "families_with", "repeated_blocks"]
