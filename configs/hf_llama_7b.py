"""A 7 B-parameter Llama (Llama-2-7B's shapes: 32 layers, width 4096, 32 heads, SwiGLU 11008,
vocabulary 32000), transformers' LlamaForCausalLM with random weights, on the bundled byte-level
corpus (ids below 256 of its 32000). Needs ``pip install 'kiln[hf]'``.

    kiln plan configs/hf_llama_7b.py --nproc 64 parallel.tp=8 parallel.zero=3     # memory per rank
    kiln plan configs/hf_llama_7b.py --nproc 8 parallel.zero=3 --json plan.json

A planning config: kiln plan traces its step on fake tensors in seconds without allocating it
(6,738,415,616 parameters; 27 GB of fp32 weights, 108 GB with AdamW's state and gradients), so
layouts for a cluster can be checked and sized on one CPU. Training it needs that cluster.
"""

from transformers import LlamaConfig, LlamaForCausalLM

from kiln.config import LazyCall as L

model = L(LlamaForCausalLM)(
    config=L(LlamaConfig)(
        vocab_size=32000,
        max_position_embeddings=4096,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    ),
)

data = dict(
    name="text_lm",
    batch_size=64,  # global sequences per optimizer step
    eval_batch_size=8,
    args=dict(seq_len=2048, num_samples=256, val_samples=8),
)

optim = dict(name="adamw", lr=3e-4, weight_decay=0.1, schedule="cosine", warmup_steps=100)

train = dict(
    max_steps=1000,
    eval_every=0,
    log_every=10,
    precision="bf16-mixed",
    activation_checkpointing="full",
    clip_grad_norm=1.0,
    seed=0,
)

parallel = dict()
