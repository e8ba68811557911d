"""A small Vision Transformer on scikit-learn's bundled digits (8x8 images, no download).

    kiln train configs/digits_vit.py

Reaches about 97% validation accuracy in well under a minute on 2 CPU cores.
"""

from kiln.config import LazyCall as L
from kiln.models import create_model

model = L(create_model)(
    name="vit",
    image_size=8,
    patch_size=2,  # 4x4 = 16 tokens per image
    dim=64,
    depth=4,
    heads=4,
    pool="mean",
)

data = dict(
    name="digits",
    batch_size=64,  # global batch per optimizer step
    eval_batch_size=512,
)

optim = dict(
    name="adamw",
    lr=3e-3,
    weight_decay=0.05,
    schedule="onecycle",
)

train = dict(
    max_steps=600,
    eval_every=100,
    log_every=20,
    seed=0,
)

parallel = dict()
