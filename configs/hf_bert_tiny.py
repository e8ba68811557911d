"""A tiny Hugging Face BERT for masked language modelling, randomly initialised from its
transformers config, learning kiln's bundled generated corpus with 15% of the bytes masked
(no download). Needs ``pip install 'kiln[hf]'``.

    kiln train configs/hf_bert_tiny.py
    kiln train configs/hf_bert_tiny.py --nproc 2 parallel.zero=3

The text_mlm data gives (masked ids, targets) with -100 wherever nothing was masked; kiln calls
BertForMaskedLM on the ids and scores its logits at the masked positions only. Activation
checkpointing finds bert.encoder.layer by itself; the final model is also written to RUN_DIR/hf/.
"""

from transformers import BertConfig, BertForMaskedLM

from kiln.config import LazyCall as L

model = L(BertForMaskedLM)(
    config=L(BertConfig)(
        vocab_size=256,  # bytes, the last one the mask token
        max_position_embeddings=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    ),
)

data = dict(
    name="text_mlm",
    batch_size=32,
    eval_batch_size=256,
    args=dict(seq_len=64, num_samples=2048),
)

optim = dict(name="adamw", lr=3e-3, weight_decay=0.05, schedule="onecycle")

train = dict(max_steps=200, eval_every=100, log_every=20, seed=0)
