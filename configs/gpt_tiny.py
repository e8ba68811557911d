"""A tiny GPT learning the bundled generated English-like corpus byte by byte (no download).

    kiln train configs/gpt_tiny.py
    kiln train configs/gpt_tiny.py --nproc 4 parallel.tp=2 parallel.pp=2

The validation loss falls from ln(256) = 5.5 nats to about 1 in a few hundred steps on CPU.
"""

from kiln.config import LazyCall as L
from kiln.models import create_model

model = L(create_model)(
    name="gpt",
    vocab_size=256,  # bytes
    seq_len=64,
    dim=64,
    depth=4,
    heads=4,
)

data = dict(
    name="text_lm",
    batch_size=32,  # global batch of sequences per optimizer step
    eval_batch_size=256,
    args=dict(seq_len=64),
)

optim = dict(
    name="adamw",
    lr=3e-3,
    weight_decay=0.05,
    schedule="onecycle",
)

train = dict(
    max_steps=300,
    eval_every=100,
    log_every=20,
    seed=0,
)

parallel = dict()
