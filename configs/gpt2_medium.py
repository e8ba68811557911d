"""GPT-2 medium (355 M parameters), the published size, on the bundled byte-level corpus.

    kiln plan configs/gpt2_medium.py                       # memory per rank, before building
    kiln train configs/gpt2_medium.py --nproc 8 parallel.tp=4 parallel.pp=2 model.vocab_size=50304

24 layers, width 1024, 16 heads, 1024 positions, tied embeddings: 354,823,168 parameters,
as in the published model. Its vocabulary of 50257 (GPT-2's BPE) is kept for the count, though
the bundled corpus uses only the first 256 ids; 50257 is prime to every tensor-parallel degree,
so with parallel.tp > 1 pad it to 50304 (a multiple of 128, as Megatron and nanoGPT do).
On CPU this is a planning and smoke-test config: one step takes seconds.
"""

from kiln.config import LazyCall as L
from kiln.models import create_model

model = L(create_model)(
    name="gpt",
    vocab_size=50257,
    seq_len=1024,
    dim=1024,
    depth=24,
    heads=16,
    tie_embeddings=True,
)

data = dict(
    name="text_lm",
    batch_size=8,  # global sequences per optimizer step
    eval_batch_size=8,
    args=dict(seq_len=1024, num_samples=512, val_samples=16),
)

optim = dict(
    name="adamw",
    lr=3e-4,
    weight_decay=0.1,
    schedule="cosine",
)

train = dict(
    max_steps=100,
    eval_every=50,
    log_every=10,
    precision="bf16-mixed",
    activation_checkpointing="full",
    clip_grad_norm=1.0,
    seed=0,
)

parallel = dict()
