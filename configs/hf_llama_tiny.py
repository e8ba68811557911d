"""A tiny Hugging Face Llama (grouped-query attention, rotary positions, SwiGLU), randomly
initialised from its transformers config, learning kiln's bundled generated corpus byte by byte
(no download). Needs ``pip install 'kiln[hf]'``.

    kiln train configs/hf_llama_tiny.py
    kiln train configs/hf_llama_tiny.py --nproc 2 parallel.zero=2

kiln calls LlamaForCausalLM on the token ids and computes the loss of its logits against the next
bytes; activation checkpointing finds model.layers by itself; the final model is also written to
RUN_DIR/hf/ for LlamaForCausalLM.from_pretrained.
"""

from transformers import LlamaConfig, LlamaForCausalLM

from kiln.config import LazyCall as L

model = L(LlamaForCausalLM)(
    config=L(LlamaConfig)(
        vocab_size=256,  # bytes
        max_position_embeddings=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
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
