"""A small Vision Transformer on scikit-learn's bundled digits (8x8 images, no download).

    kiln train configs/digits_vit.py

Measured on an idle 2-core AMD EPYC (torch 2.13 CPU, capability AVX2), train.seed=0..4:
final validation accuracy (297 images) min 97.64%, median 98.32%, max 98.99% (98.99, 97.64,
98.32, 97.64, 98.65); training took 22.3-26.7 s (median 22.6 s, summary.json wall_seconds),
about 26 s for the whole command (37-45 s while other jobs shared the cores).
tests/test_demo.py trains seed 5 (98.32%) and fails below 97%.

The accuracy has margin over 97% because a run's last bits differ between CPUs and thread
counts: with train.threads=1 (other rounding) seeds 0..5 gave min 97.98%, median 98.32%. With the
first settings (AdamW 3e-3, weight decay 0.05, 600 steps) seeds 0..4 ended between 94.95% and
97.98%, the model fitting the 1500 training images (train loss ~0.01) with validation loss
0.08-0.17; stronger decoupled weight decay, a lower peak lr and 1000 steps (43 epochs) bring
validation loss to 0.03-0.09. Dropout 0.1 (1000 steps: a seed at 95.6%) and random 1-pixel
shifts of the images (84% after 600 steps: a patch-2 ViT learns them slowly) did worse.
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
    lr=2e-3,  # with weight_decay 0.5: 1.5e-3 left a seed under 97%, 3e-3 did almost as well
    weight_decay=0.5,  # AdamW's decoupled decay; 0.05 overfit (see above)
    schedule="onecycle",
)

train = dict(
    max_steps=1000,  # 800 (lr 3e-3, weight_decay 0.5) left every seed at 96.3-97.0%
    eval_every=100,
    log_every=20,
    seed=0,
)

parallel = dict()
