"""ViT-B/16 (86.6 M parameters) on generated 224-pixel images: the model of seed 004's table.

    kiln train configs/vit_b16.py                 # on a GPU: bf16-mixed by train.precision=auto
    kiln bench vit --device cuda                  # Meta's faster-ViT table at this size

Patch 16, width 768, depth 12, 12 heads, MLP 3072, a class token, 1000 classes: 86,567,656
parameters, as the published ViT-B/16 (timm's vit_base_patch16_224). The data are kiln's
synthetic_images at ImageNet's shape (3 x 224 x 224, 1000 classes), made at start-up, with no
download: 1,024 training images (616 MB in fp32) that the epochs go through again, enough to
measure training speed, not to learn anything worth the name. On CPU a step takes many seconds;
this config is for a GPU (a plan on CPU: kiln plan configs/vit_b16.py).
"""

from kiln.config import LazyCall as L
from kiln.models import create_model

model = L(create_model)(
    name="vit",
    image_size=224,
    patch_size=16,  # 14 x 14 = 196 patches, 197 tokens with the class token
    in_channels=3,
    num_classes=1000,
    dim=768,
    depth=12,
    heads=12,
    mlp_ratio=4.0,  # MLP 3072
    pool="cls",
)

data = dict(
    name="synthetic_images",
    batch_size=128,  # global images per optimizer step
    eval_batch_size=128,
    # a 77 MB batch of fp32 images is stacked and pinned by worker processes, not by the
    # process that feeds the GPU
    workers="auto",
    args=dict(image_size=224, channels=3, num_classes=1000, num_samples=1024, val_samples=128),
)

optim = dict(
    name="adamw",
    lr=5e-4,
    weight_decay=0.05,
    schedule="onecycle",
)

train = dict(
    max_steps=200,
    eval_every=0,
    log_every=20,
    seed=0,
)

parallel = dict()
