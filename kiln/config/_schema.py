"""The fixed namespaces of a kiln config and every key's default.

```model`` is not here: its keys are the options of the chosen model (its dataclass config in
the registry) or the arguments of a ``_target_``. ``data.args`` likewise holds the keyword
arguments of the chosen dataset builder; a ``data._target_`` (the user's own function that
returns train and validation datasets) takes every key of ``data`` not declared below. Everything else is declared below, with its type and
a comment, so that validation can reject unknown keys and wrong types before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, Union


@dataclass
class DataConfig:
    name: str = "digits"  # dataset from the registry: kiln.data.list_datasets()
    args: dict = field(default_factory=dict)  # keyword arguments of that dataset's builder
    # the file a data set reads (tokens: nanoGPT's train.bin, a flat array of uint16 or uint32
    # token ids); None: tokens generates its stream. Only for a data set that reads a file.
    path: Optional[str] = None
    # its validation file (tokens: nanoGPT's val.bin); None: tokens holds out the end of data.path
    val_path: Optional[str] = None
    batch_size: int = 64  # GLOBAL samples per optimizer step, whatever the layout
    eval_batch_size: int = 512  # samples per evaluation batch (no gradients, so larger)
    workers: Union[int, Literal["auto"]] = 0  # loader processes; auto: usable CPUs per local rank
    pin_memory: Union[bool, Literal["auto"]] = "auto"  # auto: on when training on CUDA
    persistent_workers: Optional[bool] = None  # keep workers between epochs; None: on with workers
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead; None: torch's 2
    drop_last: bool = True  # drop the samples an epoch leaves after its whole global batches; false: a short last step
    collate_fn: Any = None  # L(fn)(...) or "pkg.module.fn": merges samples into a batch; None: torch's default
    # what the batches are, for the default loss, how targets line up with logits, and the
    # metrics: classification | lm (causal: a mapping's labels are its inputs, token t predicts
    # t + 1) | mlm (masked: each position against its own label, -100 where nothing is masked) |
    # seq2seq (an encoder-decoder's decoder labels, each position its own); None: the model's
    # class says (transformers' *ForCausalLM, *ForMaskedLM, an encoder-decoder's
    # *ForConditionalGeneration, *ForSequenceClassification), else the registered data set's own,
    # else the first batch (one target per sample is classification, one per token lm)
    task: Optional[Literal["classification", "lm", "mlm", "seq2seq"]] = None

    @classmethod
    def loader_keys(cls) -> tuple[str, ...]:
        """The keys that configure the loader, whatever makes the data. The others choose a
        registered data set (name, args) and its files (path, val_path); with a data._target_
        those are refused (name, args) or are the target's own arguments (path, val_path)."""
        return tuple(f.name for f in fields(cls) if f.name not in ("name", "args", "path", "val_path"))


@dataclass
class OptimConfig:
    name: str = "adamw"  # optimizer: a key of kiln.optim.OPTIMIZERS (adamw, adam, sgd, lamb, lars)
    lr: float = 1e-3  # peak learning rate
    weight_decay: Optional[float] = None  # None: the optimizer's own default (AdamW 0.01, others 0)
    # betas, eps, momentum, nesterov: each optimizer class declares which it takes (config_options)
    betas: Optional[tuple[float, float]] = None  # Adam-family betas; None: optimizer default
    eps: Optional[float] = None  # None: optimizer default (1e-8 Adam/AdamW, 1e-6 LAMB)
    momentum: Optional[float] = None  # SGD/LARS momentum; None: default (SGD 0, LARS 0.9)
    nesterov: bool = False  # Nesterov momentum for SGD/LARS
    contiguous: bool = True  # kiln's arena: all parameters and grads in one flat buffer
    # kiln: kiln's optimizer (arena, or multi-tensor where the layout has no arena); torch-forloop,
    # torch-foreach, torch-fused: torch.optim's class of the same name (adamw, adam, sgd) with that
    # implementation (foreach=False / foreach=True / fused=True), as a plain PyTorch script builds
    # it, for comparisons (kiln bench vit); optim.contiguous does not apply to it
    impl: Literal["kiln", "torch-forloop", "torch-foreach", "torch-fused"] = "kiln"
    no_decay_1d: bool = True  # no weight decay for biases and norm weights (ndim <= 1)
    schedule: Literal["constant", "cosine", "linear", "onecycle"] = "constant"  # lr schedule
    warmup_steps: int = 0  # linear warm-up steps (cosine, linear and constant schedules)
    min_lr_ratio: float = 0.0  # final lr as a fraction of lr (cosine, linear)


@dataclass
class EarlyStoppingConfig:
    metric: str = "eval_loss"  # eval_loss or eval_accuracy
    mode: Literal["min", "max"] = "min"  # min for losses, max for accuracies
    patience: int = 5  # evaluations without improvement before stopping
    min_delta: float = 0.0  # smaller changes do not count as improvement


@dataclass
class TrainConfig:
    max_steps: Optional[int] = None  # optimizer steps to run; None: use train.epochs
    epochs: Optional[int] = None  # passes over the training set (when max_steps is None)
    eval_every: int = 0  # evaluate every N steps; 0: only at the end
    log_every: int = 10  # log train loss, lr and speed every N steps
    seed: int = 0  # seeds Python, NumPy and torch; same seed on CPU = same run, bit for bit
    output_dir: str = "runs"  # where run directories are created
    run_name: Optional[str] = None  # run directory prefix; None: the config file's name
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    threads: Optional[int] = None  # torch intra-op CPU threads; None: torch's default
    # auto: fp32 or bf16-mixed, whichever trains this model faster (a CPU with native bf16: both
    # timed on the model at setup; emulated bf16: fp32; a GPU with bf16 units: bf16-mixed) |
    # fp32 | bf16-mixed | fp16-mixed (autocast; fp32 params, grads and optimizer state; fp16
    # with dynamic loss scaling) | bf16-true (bf16 params and activations, fp32 master weights
    # and optimizer state) | fp8 (bf16-mixed, with the model's linear layers in float8 through
    # torchao's rowwise recipe: an NVIDIA GPU of compute capability 8.9+ and pip install
    # 'kiln[fp8]') | fp64 (for numerical checks). See kiln/precision/__init__.py.
    precision: Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp8", "fp64"] = "auto"
    accumulate: int = 1  # micro-batches per optimizer step, each data.batch_size / accumulate
    clip_grad_norm: Optional[float] = None  # clip the global gradient norm (after unscaling)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"  # recompute blocks
    ac_every: int = 2  # selective checkpointing: every ac_every-th of the repeated blocks
    # dotted path of the model's repeated blocks (e.g. transformer.h); None: found by kiln, the
    # largest ModuleList or Sequential of children of one type
    ac_blocks: Optional[str] = None
    # torch.compile the model (inductor C++ on CPU, Triton on GPU); auto: on a GPU (CUDA), not on
    # a CPU, nor under a pipeline or parallel.auto (config.yaml records what auto became)
    compile: Union[bool, Literal["auto"]] = False
    # measure the peak of live tensor memory over the first two steps (summary.json's
    # peak_tensor_memory_mb: the CUDA allocator's, or on CPU the profiler's record of every
    # allocation); false: not measured (null), no profiler
    measure_memory: bool = True
    # the peak tensor memory a process may use, e.g. 8GB, 512MB, 1.5GiB (or bytes), for
    # parallel.auto's choice and the check that a config fits before kiln train starts it
    # (kiln.plan.check_fits); None: the device's memory (a GPU's; on CPU the memory available
    # now, divided among the local processes)
    memory_budget: Optional[Union[int, str]] = None
    progress: Literal["auto", "bar", "plain", "none"] = "auto"  # auto: bar on a terminal
    checkpoint_every: int = 0  # save a checkpoint every N steps; 0: only the final one
    keep_checkpoints: int = 3  # periodic checkpoints kept (final.pt and best.pt always are)
    # write checkpoints in the background: a save copies the state into host memory (a second
    # copy of it, kept for the run) and the next steps run while DCP's async_save writes it; at
    # most one save in flight, the next waits for it, and the run ends once the last is on disk.
    # The write's CPU time (1.2-1.9 s for 654 MiB on an EPYC core) is hidden only where a core is free
    # for it (a GPU run); where the steps fill the cores it slows them by as much (kiln bench checkpoint)
    async_checkpoint: bool = False
    # csv (RUN_DIR/metrics.csv) is always on; tensorboard (RUN_DIR/tensorboard), wandb (WANDB_PROJECT,
    # WANDB_MODE=offline), mlflow (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME): rank 0 logs the
    # config, each metrics.csv row and summary.json; a resume continues the same logged run
    loggers: list[Literal["csv", "tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["csv"])
    early_stopping: Optional[EarlyStoppingConfig] = None  # e.g. {metric: eval_accuracy, mode: max}
    # evaluate with autograd on, as a hand-written loop without torch.no_grad does (slower, more
    # memory); exists only so that `kiln bench pipeline` can measure what forgetting no_grad costs
    eval_grad: bool = False
    # L(fn)(...) with fn(outputs, batch, **kwargs) -> scalar loss (or a class whose instances are
    # such callables); None: the loss the model returns, else the task's cross-entropy on logits
    loss: Any = None
    # {name: L(fn)(...)} with fn(outputs, batch, **kwargs) -> the batch's mean value, averaged
    # over the validation set by samples; None: the task's (accuracy; lm, mlm, seq2seq: + perplexity)
    metrics: Optional[dict] = None
    # call the model as model(inputs, targets) on tuple batches, for a forward that takes the
    # targets and returns the loss (nanoGPT's forward(idx, targets) -> (logits, loss))
    pass_targets: bool = False
    # a causal LM's head and cross-entropy in chunks of rows, the gradient made in the same pass,
    # so that whole logits (B x T x V floats, and their gradient) never exist
    # (kiln/train/_chunked_loss.py); also in evaluation. auto: on where the model declares its
    # output projection (kiln's GPT; Hugging Face Llama, Mistral, Qwen2, GPT-2) and the task is
    # lm, without train.loss, train.metrics, train.pass_targets or a pipeline | true: also for a
    # recognised Hugging Face causal LM, refused where it cannot apply | false: whole logits
    chunked_lm_loss: Union[bool, Literal["auto"]] = "auto"


@dataclass
class ParallelConfig:
    # The world is a dp x tp x pp grid of processes (kiln.parallel.Layout); dp * tp * pp must
    # equal the number of processes started.

    # true: kiln train --nproc N chooses dp x tp x pp, zero, train.accumulate and
    # train.activation_checkpointing before any process starts: the fastest by kiln's cost model
    # whose planned peak fits train.memory_budget (kiln/plan/search.py); the run's config.yaml holds
    # the choice and parallel.auto=false, so a rerun from it trains the same layout
    auto: bool = False
    dp: Optional[int] = None  # data-parallel ranks; None: world size / (tp * pp)
    tp: int = 1  # tensor-parallel ranks: each block's matmuls split Megatron-style (DTensor)
    pp: int = 1  # pipeline stages: model.blocks cut into pp consecutive groups
    # ZeRO over the data-parallel ranks: 0 replicated; 1 shard the optimizer state; 2 and the
    # gradients (both on kiln's arena); 3 and the parameters (FSDP2, multi-tensor optimizer)
    zero: Literal[0, 1, 2, 3] = 0
    # HSDP (zero=3 only): the dp ranks form this many groups of dp / replicate neighbouring ranks;
    # FSDP2 shards parameters, gradients and optimizer state over the ranks of a group (one machine's
    # fast links) and all-reduces gradients across the groups (the slow links); 1: shard over all dp
    replicate: int = 1
    sequence_parallel: bool = False  # tp > 1: norms and dropout run on sequence shards
    # pipeline schedule (pp > 1): gpipe (all forwards, then all backwards); 1f1b (a backward as soon
    # as it can, so fewer activations held); interleaved-1f1b (pp x 2 stages, stage s on rank s % pp,
    # a smaller bubble); the zero-bubble ones split each backward into input and weight gradients
    # and fill the bubble with the weight work: interleaved-zb (placed as interleaved-1f1b), zbv
    # and dualpipev (2 x pp stages in a V: rank r holds stages r and 2 pp - 1 - r; dualpipev needs
    # parallel.microbatches >= 2 x pp)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"] = "1f1b"
    microbatches: Optional[int] = None  # pp > 1: micro-batches per pipeline step; None: 2 * pp
    pp_stages: Optional[list[int]] = None  # blocks per stage (sums to the depth); None: balanced
    timeout_s: float = 600.0  # a collective waiting longer than this fails instead of hanging
    overlap_grad_reduce: bool = True  # dp > 1 on the arena: reduce gradient buckets during the last backward
    # zero 1/2, with overlap_grad_reduce and without train.compile: each step's parameter
    # exchange runs into the next forward, each module waiting for its own parameters only
    overlap_param_gather: bool = True


NAMESPACES: dict[str, Any] = {
    "model": None,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
}
