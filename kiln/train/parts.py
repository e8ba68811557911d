"""The pieces ``kiln train`` builds a run from, for the tools that run them apart from a run:
``kiln plan`` traces the set-up and a step on fake tensors, ``kiln bench plan`` measures a real
step's tensor memory (and ``kiln bench lm`` a plain loop's, as kiln measures its own). They are kiln train's own functions (what is planned is the code that
runs), named here so that those tools need no private module of ``kiln.train``; they change
with kiln train and are not an API for users.
"""

from kiln.train._batches import Batches, Step, steps_per_epoch
from kiln.train._build import build_data, build_model, build_scheduler, build_task, check_model
from kiln.train._tensor_peak import _running_peak as running_peak
from kiln.train._tensor_peak import TensorMemory, live_tensor_bytes
from kiln.train._setup import Meter, lay_out, setup
from kiln.train._setup import _check_steps as check_steps
from kiln.train._setup import _to as to_device
from kiln.train.loop import train_step

__all__ = ["Batches", "Meter", "Step", "TensorMemory", "build_data", "build_model", "build_scheduler", "build_task", "check_model",
           "check_steps", "lay_out", "live_tensor_bytes", "running_peak", "setup", "steps_per_epoch", "to_device",
           "train_step"]
