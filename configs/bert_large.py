"""BERT-large (24 layers, width 1024, 16 heads, 512 positions, vocabulary 30522), the published
size, masked-LM on the bundled byte-level corpus.

    kiln plan configs/bert_large.py
    kiln train configs/bert_large.py --nproc 8 parallel.tp=2 parallel.pp=4

kiln's BERT is pre-norm, with a final LayerNorm (2 x 1024) where the original has token-type
embeddings (2 x 1024), and no pooler (see kiln/models/bert.py): 335,174,458 parameters with
tied embeddings, the count of the original's masked-LM model. The vocabulary is kept for the count; the bundled corpus uses the first
256 ids. 30522 = 2 x 15261: parallel.tp=2 divides it; for tp=4 or 8 pad it to 30528 or 30720.
On CPU this is a planning and smoke-test config.
"""

from kiln.config import LazyCall as L
from kiln.models import create_model

model = L(create_model)(
    name="bert",
    vocab_size=30522,
    seq_len=512,
    dim=1024,
    depth=24,
    heads=16,
    tie_embeddings=True,
)

data = dict(
    name="text_mlm",
    batch_size=8,
    eval_batch_size=8,
    args=dict(seq_len=512, num_samples=512, val_samples=16),
)

optim = dict(
    name="adamw",
    lr=1e-4,
    weight_decay=0.01,
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
