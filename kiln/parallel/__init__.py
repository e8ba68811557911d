"""Multi-process training on torch.distributed: ``kiln.parallel``.

- :func:`init_distributed`, :func:`rank`, :func:`world_size`, :func:`is_main`: process group
  set-up from torchrun's environment (a no-op in one process).
- zero=0, data parallel on the arena: :func:`broadcast_parameters` once at start,
  :func:`all_reduce_gradients` once per optimizer step. One reducer averages gradients for
  every stage (:mod:`kiln.parallel._reducer`): in buckets of the arena's flat gradients,
  reduced during the backward run inside :func:`sync_gradients` (the step's last
  micro-batch) with ``overlap=True``, else all launched after it; the stage chooses the
  collective.
- :class:`ZeroOptimizer`: ZeRO stage 1 (sharded optimizer state) and stage 2 (sharded state
  and gradients) around a kiln optimizer; each rank owns one contiguous shard of each arena.
- :meth:`Parallel.data_parallel`: the trainer's choice among these for its optimizer.

- zero=3: :func:`apply_fsdp` (FSDP2 ``fully_shard`` per block, then the root); kiln's
  optimizers with ``contiguous=False`` step the DTensor shards.
- tensor parallel: :func:`apply_tp` (Megatron-style sharding with DTensor, as the model
  family's registered plan says: ``kiln.models.ParallelPlan``), :func:`check_tp`; pipeline
  parallel: :func:`build_pipeline` (GPipe, 1F1B, interleaved 1F1B, and the zero-bubble
  interleaved ZB, ZB-V and DualPipeV, cut where the family's plan says), :func:`check_pipeline`;
  :data:`PP_SCHEDULES` (their names), :data:`SPLIT_BACKWARD` (the zero-bubble ones, whose
  backward splits into input and weight passes), :func:`stage_ranks` (the pp rank of each
  stage) and :func:`schedule_bubble` (each one's textbook bubble).
- :func:`clip_grad_norm_` (``kiln.optim.clip_grad_norm_``): the global norm over any mix of
  plain, arena, ZeRO-shard, tensor-parallel and FSDP2 gradients and pipeline stages.
- :class:`Layout` and :func:`parallelize`: a model laid out over ``dp x tp x pp`` ranks in one
  call (stages, then tensor parallel, then FSDP2 over dp, or HSDP: ``Layout.replicate`` groups,
  :func:`fsdp_mesh`), as the trainer does it;
  :func:`check_parallel_config`: a config's layout checked against its model and batch
  before anything is built.
- :func:`save_sharded` / :func:`load_sharded`: DCP checkpoints keyed per parameter (FQN) that
  load at any world size into plain, ZeRO-1/2 or FSDP2 runs.

See :mod:`kiln.parallel._zero` for the per-step call order a trainer follows.
"""

import importlib
from typing import Any

from kiln.parallel._dist import init_distributed, is_main, rank, world_size
from kiln.parallel._zero import ZeroOptimizer, all_reduce_gradients, broadcast_parameters, sync_gradients
from kiln.optim import clip_grad_norm_  # the one global-norm clip, for every layout's gradients

# FSDP2 and DCP take most of a second to import: loaded when first used, not by every trainer.
_LAZY = {"apply_fsdp": "_fsdp", "is_fsdp": "_fsdp", "apply_tp": "_tp", "check_tp": "_tp",
         "build_pipeline": "_pp", "check_pipeline": "_pp", "schedule_bubble": "_pp", "PP_SCHEDULES": "_pp",
         "SPLIT_BACKWARD": "_pp", "stage_ranks": "_pp", "parallelize": "_layout", "Parallel": "_layout",
         "stage_elements": "_layout", "Layout": "_mesh", "resolve_layout": "_mesh", "build_mesh": "_mesh",
         "dp_mesh": "_mesh", "fsdp_mesh": "_mesh",
         "check_parallel_config": "_checks",
         "save_sharded": "_checkpoint", "load_sharded": "_checkpoint", "read_sharded": "_checkpoint",
         "check_sharded": "_checkpoint", "META_FILE": "_checkpoint", "AsyncSaver": "_checkpoint"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kiln.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kiln.parallel.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = ["init_distributed", "rank", "world_size", "is_main", "ZeroOptimizer",
           "broadcast_parameters", "all_reduce_gradients", "sync_gradients", "apply_fsdp", "clip_grad_norm_", "is_fsdp",
           "apply_tp", "check_tp", "build_pipeline", "check_pipeline", "schedule_bubble", "PP_SCHEDULES",
           "SPLIT_BACKWARD", "stage_ranks", "parallelize", "Parallel",
           "stage_elements", "Layout", "resolve_layout", "build_mesh", "dp_mesh", "fsdp_mesh",
           "check_parallel_config",
           "save_sharded", "AsyncSaver", "load_sharded", "read_sharded", "check_sharded", "META_FILE"]
