"""A kiln config for tests/test_user_models.py: nine model families as their users write them,
trained on padded mapping batches (``input_ids``, ``attention_mask``, ``labels`` with -100 at
the padding). ``model.family`` and ``data.family`` pick one of them::

    kiln train tests/user_families.py model.family=t5 data.family=t5
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from kiln.config import LazyCall as L

V, T = 64, 12  # vocabulary, padded length


def make_model(family):
    import transformers as tr

    if family == "qwen2":
        return tr.Qwen2ForCausalLM(tr.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    if family == "mistral":
        return tr.MistralForCausalLM(tr.MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    if family == "neox":
        return tr.GPTNeoXForCausalLM(tr.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                      num_attention_heads=4, max_position_embeddings=64))
    if family == "opt":
        return tr.OPTForCausalLM(tr.OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                              max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0))
    if family == "phi":
        return tr.PhiForCausalLM(tr.PhiConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0))
    if family == "gpt2cls":
        return tr.GPT2ForSequenceClassification(tr.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                              num_labels=4, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if family == "t5":
        return tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                         dropout_rate=0.0, decoder_start_token_id=0))
    if family == "distilbert":
        return tr.DistilBertForMaskedLM(tr.DistilBertConfig(vocab_size=V, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                                            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0))
    if family == "user":
        return TinyLM()
    raise ValueError(family)


class TinyLM(nn.Module):
    """A user's own causal model that takes HF-style mapping batches and returns {"loss"}."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(32, V)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())  # mean over scored tokens
        return {"loss": loss}


class Padded(Dataset):
    """Token sequences of random length, padded to T (id 0, label -100), labelled for `family`."""

    def __init__(self, family, n, seed, labels=True):
        self.with_labels = labels
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, V - 1, (n, T), generator=g)
        lengths = torch.randint(3, T + 1, (n,), generator=g)
        self.mask = (torch.arange(T)[None] < lengths[:, None]).long()
        self.ids = ids * self.mask
        if family == "gpt2cls":
            self.labels = torch.randint(0, 4, (n,), generator=g)
        elif family == "t5":
            self.labels = torch.randint(1, V, (n, 6), generator=g)
            short = torch.randint(2, 7, (n,), generator=g)
            self.labels[torch.arange(6)[None] >= short[:, None]] = -100
        elif family == "distilbert":
            masked = (torch.rand(n, T, generator=g) < 0.3) & (self.mask > 0)
            masked[:, 0] = True  # at least one scored position per sample
            self.labels = self.ids.masked_fill(~masked, -100)
            self.ids = self.ids.masked_fill(masked, V - 1)
        else:
            self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        sample = {"input_ids": self.ids[i], "attention_mask": self.mask[i]}
        return {**sample, "labels": self.labels[i]} if self.with_labels else sample


def padded(family, n=96, val=40, labels=True):
    return Padded(family, n, 1, labels), Padded(family, val, 2, labels)


family = "qwen2"
model = L(make_model)(family=family)
data = L(padded)(family=family, batch_size=16, eval_batch_size=20)
optim = dict(name="adamw", lr=1e-2, weight_decay=0.01, no_decay_1d=False, schedule="constant")
train = dict(max_steps=8, log_every=1, eval_every=0, precision="fp32", progress="none")
