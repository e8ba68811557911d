"""The pieces ``kiln train`` builds a run from, for the tools that run them apart from a run:
``kiln plan`` builds each rank through setup's own stages (:mod:`kiln.train._setup`) on fake
tensors and traces a step, ``kiln bench plan`` measures a real step's tensor memory (and
``kiln bench lm`` a plain loop's, as kiln measures its own). They are kiln train's own
functions (what is planned is the code that runs), named here so that those tools need no
private module of ``kiln.train``; they change with kiln train and are not an API for users.
"""

from kiln.train._batches import Batches, Step, steps_per_epoch
from kiln.train._build import build_data, build_model, build_scheduler, build_task, check_model
from kiln.train._tensor_peak import _running_peak as running_peak
from kiln.train._tensor_peak import TensorMemory, live_tensor_bytes
from kiln.train._setup import (Built, Meter, Place, StepContext, join, lay_out, load_data, make_model, make_optimizer,
                               open_run_dir, restore, settle_precision, setup, step_context)
from kiln.train._setup import _check_steps as check_steps
from kiln.train._setup import _to as to_device
from kiln.train.loop import train_step

# setup's stages, in the order it calls them (kiln plan calls those of them a dry run has a use for)
STAGES = (join, load_data, make_model, settle_precision, lay_out, make_optimizer, step_context, restore, open_run_dir)

__all__ = ["Batches", "Built", "Meter", "Place", "STAGES", "Step", "StepContext", "TensorMemory", "build_data",
           "build_model", "build_scheduler", "build_task", "check_model", "check_steps", "join", "lay_out",
           "live_tensor_bytes", "load_data", "make_model", "make_optimizer", "open_run_dir", "restore",
           "running_peak", "settle_precision", "setup", "step_context", "steps_per_epoch", "to_device", "train_step"]
