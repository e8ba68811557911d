"""The parallel plans of Hugging Face families (kiln/models/hf_plans.py) and the checks made
before anything starts; one process, no process group (the layouts themselves run in
tests/test_hf_parallel.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.config import ConfigError, validate  # noqa: E402
from kiln.models import find_plan  # noqa: E402
from kiln.parallel import check_parallel_config  # noqa: E402
from kiln.parallel._pp import _pp_plan  # noqa: E402
from kiln.parallel._tp import _matches, tp_sharded_names  # noqa: E402

T = "transformers."
LLAMA_CFG = dict(_target_=T + "LlamaConfig", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)
FAMILIES = {
    "llama": (T + "LlamaForCausalLM", LLAMA_CFG),
    "mistral": (T + "MistralForCausalLM", {**LLAMA_CFG, "_target_": T + "MistralConfig"}),
    "qwen2": (T + "Qwen2ForCausalLM", {**LLAMA_CFG, "_target_": T + "Qwen2Config"}),
    "gpt2": (T + "GPT2LMHeadModel", dict(_target_=T + "GPT2Config", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=16)),
    "bert": (T + "BertForMaskedLM", dict(_target_=T + "BertConfig", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=16)),
}


def _node(family: str, **config: object) -> dict:
    cls, cfg = FAMILIES[family]
    return {"_target_": cls, "config": {**cfg, **config}}


def _model(family: str) -> torch.nn.Module:
    from kiln.config import instantiate

    torch.manual_seed(0)
    return instantiate(_node(family))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_pattern_names_a_module_and_the_pipeline_plan_fits(family):
    model = _model(family)
    plan = find_plan(model)
    assert plan is not None and plan.capabilities == {"tp", "pp"}
    paths = [p for p, _ in model.named_modules() if p]
    for pattern in plan.tp.styles:
        assert any(_matches(pattern, p) for p in paths), f"{family}: {pattern} names no module"
    _pp_plan(model)  # raises when a parameter lies outside first/repeated/last


def test_sharded_parameters_are_megatrons():
    llama = tp_sharded_names(_model("llama"))
    assert llama == {"model.embed_tokens.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{m}.weight" for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    gpt2 = tp_sharded_names(_model("gpt2"))
    # the fused q/k/v Conv1D and the MLP's first Conv1D split weight and bias; the rowwise ones the weight only
    assert {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias",
            "transformer.h.0.mlp.c_fc.bias", "transformer.h.0.attn.c_proj.weight"} <= gpt2
    assert "transformer.h.0.attn.c_proj.bias" not in gpt2 and "transformer.wpe.weight" not in gpt2
    bert = tp_sharded_names(_model("bert"))
    assert "bert.encoder.layer.1.attention.self.query.weight" in bert and "bert.embeddings.LayerNorm.weight" not in bert


def test_a_planned_family_with_another_head_has_no_plan():
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4))
    assert find_plan(model) is None


def _cfg(family: str, parallel: dict, **config: object) -> dict:
    return validate({"model": _node(family, **config), "data": {"name": "text_lm", "batch_size": 8,
                                                               "args": {"seq_len": 16, "num_samples": 64}},
                     "parallel": parallel, "train": {"max_steps": 2}})


@pytest.mark.parametrize("parallel, config, match", [
    ({"tp": 4}, {}, r"parallel.tp=4 does not divide config.num_key_value_heads=2 \(grouped-query attention.*"
                    r"config.num_attention_heads=4 query heads\); choose tp dividing 2"),
    ({"tp": 2}, {"vocab_size": 63}, r"parallel.tp=2 does not divide config.vocab_size=63 \(pad the vocabulary to 64"),
    ({"tp": 2}, {"intermediate_size": 65}, r"does not divide config.intermediate_size=65"),
    ({"pp": 4}, {}, r"model.config.num_hidden_layers=2 blocks, fewer than the pp=4 pipeline stages"),
    ({"pp": 2}, {"tie_word_embeddings": True}, r"model.config.tie_word_embeddings=true ties .* set "
                                               r"model.config.tie_word_embeddings=false"),
    ({"pp": 2, "tp": 2, "sequence_parallel": True}, {}, r"stages read the sequence length from their input"),
])
def test_bad_layouts_of_an_hf_llama_are_refused_before_anything_starts(parallel, config, match):
    with pytest.raises(ConfigError, match=match):
        check_parallel_config(_cfg("llama", parallel, **config))


def test_gpt2_and_bert_numbers_are_checked_with_their_own_names():
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide config.n_head=4"):
        check_parallel_config(_cfg("gpt2", {"tp": 3}))
    with pytest.raises(ConfigError, match=r"config.num_attention_heads=4"):
        check_parallel_config(_cfg("bert", {"tp": 3}))
    check_parallel_config(_cfg("gpt2", {"tp": 2, "sequence_parallel": True}))  # fits: no error


def test_a_family_without_a_plan_is_refused_with_the_list_of_those_with_one():
    node = {"_target_": T + "LlamaForSequenceClassification", "config": LLAMA_CFG}
    cfg = validate({"model": node, "data": {"name": "text_lm", "batch_size": 8,
                                            "args": {"seq_len": 16, "num_samples": 64}},
                    "parallel": {"tp": 2}, "train": {"max_steps": 2}})
    with pytest.raises(ConfigError, match=r"parallel.tp=2 needs a model family with a tensor-parallel plan \(.*"
                                          r"hf llama: LlamaForCausalLM.*hf gpt2: GPT2LMHeadModel.*\); "
                                          r"model._target_='transformers.LlamaForSequenceClassification' has none"):
        check_parallel_config(cfg)


@pytest.mark.e2e  # a kiln process importing transformers
def test_kiln_train_refuses_with_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kiln", "train", "configs/hf_llama_tiny.py", "--nproc", "4",
                           "parallel.tp=4", f"train.output_dir={tmp_path}"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["kiln: error: parallel.tp=4 does not divide config.num_key_value_heads=2 (grouped-query "
                     "attention: each rank needs whole key/value heads, and config.num_attention_heads=4 query "
                     "heads); choose tp dividing 2"]
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
