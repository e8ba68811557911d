"""GPT-2 small (124 M parameters) on token files, or with none on a generated token stream.

    kiln plan configs/gpt2_small.py                        # memory per rank, before building
    kiln train configs/gpt2_small.py                       # the generated stream: no download
    kiln train configs/gpt2_small.py data.path=train.bin data.val_path=val.bin   # nanoGPT's files
    # a smoke run on a CPU (one step of 4 x 128 tokens takes seconds):
    kiln train configs/gpt2_small.py data.args.seq_len=128 data.batch_size=4 data.eval_batch_size=4 \\
        data.args.val_samples=4 train.max_steps=4

12 layers, width 768, 12 heads, 1024 positions, tied embeddings, biases as in GPT-2: 124,475,904
parameters, as nanoGPT counts its GPT-2 with the vocabulary padded from 50,257 to 50,304 (a
multiple of 128, kinder to matmuls and to tensor parallelism). Attention is causal SDPA, so a
GPU runs its flash kernel.

The data set is ``tokens``: nanoGPT-format ``.bin`` files (flat uint16 ids, as its
``data/openwebtext/prepare.py`` writes them) read through a memmap, in windows of 1024 + 1
tokens; its sequence length and vocabulary follow the model. Without data.path it trains on a
generated stream with structure to learn (a Markov chain over the vocabulary), so the loss falls.

The optimizer is nanoGPT's: AdamW at 6e-4, weight decay 0.1, betas (0.9, 0.95), clip 1.0, a
cosine schedule with warm-up down to a tenth of the peak. train.precision is left to auto:
fp32 or bf16-mixed, whichever trains faster here (timed where bf16 could win: a GPU with bf16
units, a CPU with native bf16).
A step is 16 sequences of 1024 tokens (16 K tokens), the micro-batch nanoGPT's 12 grows to on an
80 GB GPU. On a GPU the model is compiled (train.compile=auto; false on a CPU). For nanoGPT's
0.5 M-token batch set data.batch_size=480 train.accumulate=30 (16 sequences per micro-step; with
--nproc 8, train.accumulate=4 and 15 per rank), optim.warmup_steps=2000 and
train.max_steps=600000, and raise data.args.val_samples for a steadier validation loss.
"""

from kiln.config import LazyCall as L
from kiln.models import create_model

model = L(create_model)(
    name="gpt",
    vocab_size=50304,  # GPT-2's 50,257 padded to a multiple of 128
    seq_len=1024,
    dim=768,
    depth=12,
    heads=12,
    tie_embeddings=True,
)

data = dict(
    name="tokens",
    batch_size=16,  # global sequences per optimizer step: 16 x 1024 tokens
    eval_batch_size=16,
    # seq_len and vocab_size follow the model; 2,048 generated training windows without data.path
    args=dict(val_samples=128),
)

optim = dict(
    name="adamw",
    lr=6e-4,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    schedule="cosine",
    warmup_steps=20,
    min_lr_ratio=0.1,
)

train = dict(
    compile="auto",  # on a GPU: torch.compile (1.07x nanoGPT's compiled loop on an H200; eager 0.91x)
    max_steps=200,
    eval_every=100,
    log_every=10,
    clip_grad_norm=1.0,
    seed=0,
)

parallel = dict()
