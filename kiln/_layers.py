"""kiln's packages and top-level modules from the bottom up, declared once.

A module may import from its own layer and the layers below it, never from one above; within a
layer, packages import each other without a cycle. ``tests/test_layering.py`` holds every import
in ``kiln/`` to this order, and ``docs/reference/architecture.md`` draws it. The root package
(the public facade, whose names load lazily) and ``kiln.__main__`` (the ``python -m kiln``
entry point) stand outside it.
"""

LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: errors, the version, helpers any layer may use
    ("kiln._version", "kiln.errors", "kiln._cache", "kiln._plotting", "kiln._profiling", "kiln._environment",
     "kiln._layers"),
    ("kiln.hardware",),  # what this machine is; FLOPs and peaks
    ("kiln.optim", "kiln.models", "kiln.data"),  # the arena and its optimizers; plain models; data
    ("kiln.config",),  # configs, checked against the model and data registries
    ("kiln.precision", "kiln.memory", "kiln.compile"),  # techniques applied from outside a model
    ("kiln.parallel",),  # layouts over processes, sharded checkpoints
    ("kiln.hf",),  # Hugging Face models in any layout
    ("kiln.train",),  # setup, the loop, checkpoints, the run directory
    ("kiln.plan",),  # a rank's step traced on fake tensors; the layout search
    ("kiln.launch",),  # kiln train's processes, and run_distributed
    ("kiln.bench",),  # benchmarks against the plain PyTorch way
    ("kiln.commands",),  # what only the command line does: the parser, tune, doctor, export, report
)
