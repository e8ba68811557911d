"""A tiny Hugging Face GPT-2, randomly initialised from its transformers config, learning kiln's
bundled generated corpus byte by byte (no download). Needs ``pip install 'kiln[hf]'``.

    kiln train configs/hf_gpt2_tiny.py
    kiln train configs/hf_gpt2_tiny.py train.precision=bf16-mixed train.activation_checkpointing=full
    kiln train configs/hf_gpt2_tiny.py --nproc 2 parallel.zero=3

The model is transformers' own GPT2LMHeadModel: kiln calls it on the token ids, takes the logits
from its CausalLMOutput and computes the loss against the next bytes. Activation checkpointing
finds its blocks (transformer.h) by itself. At the end the model is also written in the Hugging
Face layout to RUN_DIR/hf/ (GPT2LMHeadModel.from_pretrained loads it).
"""

from transformers import GPT2Config, GPT2LMHeadModel

from kiln.config import LazyCall as L

model = L(GPT2LMHeadModel)(
    config=L(GPT2Config)(
        vocab_size=256,  # bytes
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,  # no dropout: a tiny model on a generated corpus does not overfit in 200 steps
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
)

data = dict(
    name="text_lm",
    batch_size=32,
    eval_batch_size=256,
    args=dict(seq_len=64, num_samples=2048),
)

optim = dict(name="adamw", lr=3e-3, weight_decay=0.05, schedule="onecycle")

train = dict(max_steps=200, eval_every=100, log_every=20, seed=0)
