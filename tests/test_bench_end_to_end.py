"""One real bench stage (`run_one("bench", recipe)`) on a tiny random-weight Llama target (SmolLM2's real tokenizer) and an EAGLE-3 head.

The head is wired to output a constant (zero fc and o_proj, so its layer output is the MLP's down_proj bias),
whose logits favour draft id 0, mapped to the token the target emits most: drafts are then partly accepted
and partly rejected, so the lossless comparison runs over real accept, reject and cache-rewind steps rather
than over drafts that are never accepted.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.data.config import TargetConfig
from eyas.data.packages import sha256_file
from eyas.data.targets import Target, tokenizer_hash
from eyas.eval.bench import BenchPrompt, PromptFileError, encode_prompt
from eyas.eval.config import BenchConfig, DecoderConfig, GateConfig
from eyas.eval.decoder import PlainDecoder
from eyas.eval.gate import gate_passed_for, run_gate
from eyas.eval.report import REPORT_SCHEMA_VERSION, load_report
from eyas.heads.checkpoint import HeadMismatchError, save_head
from eyas.heads.eagle3 import Eagle3Config, build_head
from eyas.recipe import Recipe
from eyas.stages import run_one

PROMPTS = [
    {"messages": [{"role": "user", "content": "Tell me about the rivers of Europe."}], "category": "chat"},
    {"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "category": "code"},
    {"messages": [{"role": "user", "content": "What should I cook tonight?"}], "category": "chat"},
    {"prompt": "import os\n\ndef list_files(path):\n", "category": "code"},
]
DECODER = DecoderConfig(mode="tree", depth=3, topk=2, budget=4, num_speculative_tokens=2, max_new_tokens=16)


def tiny_target_dir(root: Path, tokenizer) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(0)
    # initializer_range 0.1: varied output (at the default 0.02 a random model repeats one token forever).
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
                      initializer_range=0.1)
    model = LlamaForCausalLM(cfg).eval()
    path = root / "tiny-target"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


def favourite_token(model, tokenizer, prompts: list[dict], decoder: DecoderConfig) -> int:
    """The token the target emits most on these prompts: the constant head's only real proposal."""
    plain = PlainDecoder(model, tokenizer, decoder)
    emitted = Counter()
    for i, p in enumerate(prompts):
        prompt = BenchPrompt(line=i + 1, category=p["category"], messages=p.get("messages"), prompt=p.get("prompt"))
        emitted.update(plain.generate(encode_prompt(tokenizer, prompt)).tokens)
    return emitted.most_common(1)[0][0]


def constant_proposal_head(model, tokenizer, favourite: int, path: Path, tokenizer_sha: str) -> Path:
    config = Eagle3Config.from_target(model.config, draft_vocab_size=8, aux_layer_ids=[1, 2, 3])
    head = build_head(dataclasses.replace(config, mlp_bias=True))
    with torch.no_grad():
        head.fc.weight.zero_()
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.bias.fill_(1.0)  # the layer's output, whatever the input
        head.lm_head.weight.zero_()
        head.lm_head.weight[0] = 0.1  # draft id 0 wins by a wide margin
    others = [t for t in range(3, 20) if t != favourite][:7]
    target_ids = torch.tensor([favourite] + others)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    head.set_vocab(target_ids - torch.arange(8), t2d)
    return save_head(head, path, metadata={"tokenizer_hash": tokenizer_sha, "target": "tiny-random-llama"})


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_e2e")
    tokenizer = Target.resolve(TargetConfig()).tokenizer
    target_dir, model = tiny_target_dir(root, tokenizer)
    recipe = Recipe(output_dir=str(root / "run"),
                    target=TargetConfig(name_or_path=str(target_dir), dtype="float32", device="cpu"),
                    bench=BenchConfig(num_prompts=3, warmup=1, decoder=DECODER))
    # Where the data and train stages leave them, so the bench stage finds both by default.
    prompts_file = recipe.stage_dir("data") / "prompts.jsonl"
    prompts_file.parent.mkdir(parents=True)
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    favourite = favourite_token(model, tokenizer, PROMPTS[:3], DECODER)
    head_dir = constant_proposal_head(model, tokenizer, favourite, recipe.stage_dir("head") / "best",
                                      tokenizer_hash(tokenizer))
    report_path = run_one("bench", recipe) / "report.json"
    return {"report_path": report_path, "report": load_report(report_path), "head_dir": head_dir,
            "recipe": recipe, "prompts": prompts_file, "root": root, "model": model, "tokenizer": tokenizer}


def test_report_has_every_figure_and_speculative_output_is_lossless(bench_run):
    report = bench_run["report"]
    assert bench_run["report_path"] == bench_run["recipe"].stage_dir("bench") / "report.json"
    assert report["schema_version"] == REPORT_SCHEMA_VERSION
    assert report["prompts"] == 3
    assert report["lossless"] is True and report["lossless_exact_expected"] is True
    assert report["lossless_prompts"] == 3
    # transformers' own greedy generate() on the same target produces the plain decoder's tokens.
    assert report["hf_generate_token_agreement"] == 1.0
    for key in ("spec_tokens_per_s", "baseline_tokens_per_s", "speedup", "speedup_vs_hf_generate",
                "speedup_vs_prompt_lookup", "hf_generate_tokens_per_s", "prompt_lookup_tokens_per_s"):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert report["speedup"] == pytest.approx(report["spec_tokens_per_s"] / report["baseline_tokens_per_s"])
    for which in ("baseline", "spec"):
        for figure in ("ttft_ms", "itl_ms"):
            got = report[figure][which]
            assert got["p50"] <= got["p90"] <= got["p99"], (figure, which)
    for decoder in ("baseline", "spec", "chain"):
        assert set(report[decoder]["time_s"]) == {"target", "draft", "other"}
    assert report["baseline"]["time_s"]["draft"] == 0.0 and report["spec"]["time_s"]["draft"] > 0


def test_acceptance_is_real_and_alpha_comes_from_the_exported_chain_length(bench_run):
    report = bench_run["report"]
    chain = report["chain_acceptance"]
    assert report["alpha_chain_length"] == 2 and len(report["alpha_per_position"]) == 2
    assert report["alpha"] == pytest.approx(chain["accepted_tokens"] / chain["draft_tokens"])
    assert 0 < report["alpha"] < 1  # some drafts accepted, some rejected
    assert report["tau"] == pytest.approx(1 + report["acceptance"]["accepted_tokens"] / report["acceptance"]["drafts"])
    assert report["tau"] > 1
    assert report["decoder"]["mode"] == "tree" and report["decoder"]["budget"] == 4


def test_categories_hashes_and_outputs_on_disk(bench_run):
    report, head_dir = bench_run["report"], bench_run["head_dir"]
    assert set(report["by_category"]) == {"chat", "code"}  # round-robin selection covers both
    assert report["by_category"]["chat"]["prompts"] + report["by_category"]["code"]["prompts"] == 3
    assert report["by_category"]["code"]["lossless"] is True
    assert report["head"]["sha256"] == sha256_file(Path(head_dir) / "model.safetensors")
    assert len(report["target"]["sha256"]) == 64
    out = bench_run["recipe"].stage_dir("bench")
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert {"acceptance_per_position.png", "categories.png", "speedup_model.png"} <= set(report["plots"])
    summary = (out / "summary.md").read_text()
    assert "speedup vs plain decoding" in summary and "| code |" in summary
    assert not list(out.glob(".*tmp*"))  # atomic writes leave no temporaries


def test_an_unchanged_bench_is_not_measured_again_through_the_cli(bench_run, capsys):
    from eyas.cli import main
    from eyas.recipe import dump_recipe

    report_path = bench_run["report_path"]
    before = report_path.stat().st_mtime_ns
    recipe_file = bench_run["root"] / "recipe.yaml"
    recipe_file.write_text(dump_recipe(bench_run["recipe"]))
    assert main(["bench", str(recipe_file)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert report_path.stat().st_mtime_ns == before
    done = json.loads((report_path.parent / "DONE.json").read_text())
    assert done["head_sha256"] == bench_run["report"]["head"]["sha256"]


def test_gate_on_a_real_report_ties_the_verdict_to_the_head(bench_run):
    from eyas.cli import main

    report_path, report = bench_run["report_path"], bench_run["report"]
    assert main(["gate", str(report_path), "--min-alpha", "0", "--weights", "chat=0.5,code=0.5"]) == 0
    assert gate_passed_for(report["head"]["sha256"], report_path)
    assert run_gate(report_path, GateConfig(min_alpha=0.0)) == 0
    assert run_gate(report_path, GateConfig(min_alpha=0.0, min_speedup=1e6)) == 1
    assert not gate_passed_for(report["head"]["sha256"], report_path)


def test_autotune_picks_the_shape_on_held_out_prompts_and_benches_with_it(bench_run):
    recipe = dataclasses.replace(
        bench_run["recipe"], output_dir=str(bench_run["root"] / "tuned"),
        bench=BenchConfig(num_prompts=1, warmup=1, compare_hf=False, autotune=True,
                          decoder=dataclasses.replace(DECODER, max_new_tokens=6)))
    out = run_one("bench", recipe, head=str(bench_run["head_dir"]), prompts=str(bench_run["prompts"]))
    report = load_report(out / "report.json")
    tune = report["autotune"]
    assert tune["held_out"] is True and 1 not in tune["prompt_lines"]  # line 1 is the measured prompt
    chosen = [row for row in tune["table"] if row["chosen"]]
    assert len(chosen) == 1
    assert all(report["decoder"][k] == v for k, v in chosen[0]["shape"].items())
    assert report["lossless"] is True and report["speedup_vs_hf_generate"] is None


def fail_if_the_model_loads(monkeypatch):
    def load_model(self, device=None):
        raise AssertionError("the target model was loaded before the input was refused")

    monkeypatch.setattr(Target, "load_model", load_model)


def test_a_head_trained_for_another_tokenizer_is_refused_before_the_model_loads(bench_run, monkeypatch):
    bad_head = constant_proposal_head(bench_run["model"], bench_run["tokenizer"], 5, bench_run["root"] / "bad",
                                      tokenizer_sha="0" * 64)
    recipe = dataclasses.replace(bench_run["recipe"], output_dir=str(bench_run["root"] / "mismatch"))
    fail_if_the_model_loads(monkeypatch)
    with pytest.raises(HeadMismatchError, match="tokenizer"):
        run_one("bench", recipe, head=str(bad_head), prompts=str(bench_run["prompts"]))


def head_for_other_weights(bench_run) -> Path:
    """The bench's head, recorded as trained against another target's weights (same tokenizer and sizes)."""
    import shutil

    head = Path(shutil.copytree(bench_run["head_dir"], bench_run["root"] / "other-weights-head", dirs_exist_ok=True))
    meta = json.loads((head / "eyas_head.json").read_text())
    (head / "eyas_head.json").write_text(json.dumps(dict(meta, target_hash="0" * 64)))
    return head


def test_a_head_trained_against_other_weights_is_refused_before_the_model_loads(bench_run, monkeypatch):
    recipe = dataclasses.replace(bench_run["recipe"], output_dir=str(bench_run["root"] / "other-target"))
    fail_if_the_model_loads(monkeypatch)
    with pytest.raises(HeadMismatchError, match="trained against target weights 000000000000") as err:
        run_one("bench", recipe, head=str(head_for_other_weights(bench_run)), prompts=str(bench_run["prompts"]))
    assert "\n" not in str(err.value) and "allow" in str(err.value)


def test_a_loaded_machine_and_other_target_weights_are_said_in_the_report_summary_and_stderr(bench_run, monkeypatch,
                                                                                             capsys):
    """Allowed on purpose: the report is marked, summary.md and stderr say why its figures are not the head's."""
    import os

    from eyas.eval.bench import bench

    from eyas.eval import bench as bench_module

    # Another job on every core: each sample finds the machine 10 CPU-seconds busier than this process alone.
    sample = bench_module.cpu_sample
    busier = iter(range(0, 100, 10))
    monkeypatch.setattr(bench_module, "cpu_sample", lambda: dataclasses.replace(
        sample(), machine_busy_s=sample().machine_busy_s + next(busier) * 1e3))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cfg = BenchConfig(num_prompts=1, warmup=1, compare_hf=False, decoder=dataclasses.replace(DECODER, max_new_tokens=6))
    out = bench_run["root"] / "allowed"
    target = Target.resolve(bench_run["recipe"].target)
    bench(cfg, target, head_for_other_weights(bench_run), bench_run["prompts"], out, 2, allow_other_target=True)
    report = load_report(out / "report.json")
    assert report["target"]["matches_head"] is False and report["target"]["head_target_sha256"] == "0" * 64
    noise = report["noise"]
    assert noise["trustworthy"] is False and noise["other_cpu_per_core"] > 1 and noise["cpus"] == 2
    summary = (out / "summary.md").read_text()
    assert "other weights than the head was trained against" in summary
    assert "untrustworthy" in summary and "competed for the CPUs" in summary
    err = capsys.readouterr().err
    assert "other weights than the head was trained against" in err and "competed for the CPUs" in err
    assert run_gate(out / "report.json", GateConfig(min_alpha=0.0)) == 1  # never gated as the head's figures


def test_a_bad_prompts_file_is_refused_before_the_model_loads(bench_run, monkeypatch):
    bad = bench_run["root"] / "bad-prompts.jsonl"
    bad.write_text(json.dumps(PROMPTS[0]) + "\n" + json.dumps({"prompt": 3}) + "\n")
    recipe = dataclasses.replace(bench_run["recipe"], output_dir=str(bench_run["root"] / "bad-prompts"))
    fail_if_the_model_loads(monkeypatch)
    with pytest.raises(PromptFileError, match=r"bad-prompts.jsonl:2: field 'prompt'"):
        run_one("bench", recipe, head=str(bench_run["head_dir"]), prompts=str(bad))



def test_a_decoder_setting_that_cannot_decode_is_refused_before_the_model_loads(bench_run, monkeypatch):
    fail_if_the_model_loads(monkeypatch)
    with pytest.raises(ValueError, match="mode"):
        bench = dataclasses.replace(bench_run["recipe"].bench, decoder=dataclasses.replace(DECODER, mode="beam"))
        run_one("bench", dataclasses.replace(bench_run["recipe"], output_dir=str(bench_run["root"] / "beam"),
                                             bench=bench),
                head=str(bench_run["head_dir"]), prompts=str(bench_run["prompts"]))


@pytest.mark.slow
def test_real_smollm2_bench_is_lossless_and_agrees_with_transformers(tmp_path):
    """The real default target (SmolLM2-135M-Instruct, fp32) with a constant-proposal head: ~2-5 min on 2 cores."""
    from eyas.data.targets import load_target

    model, tokenizer = load_target(TargetConfig(dtype="float32", device="cpu"))
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    decoder = dataclasses.replace(DECODER, max_new_tokens=32)
    head_dir = constant_proposal_head(model, tokenizer, favourite_token(model, tokenizer, PROMPTS[:2], decoder),
                                      tmp_path / "head", tokenizer_hash(tokenizer))
    recipe = Recipe(output_dir=str(tmp_path / "run"), target=TargetConfig(dtype="float32", device="cpu"),
                    bench=BenchConfig(num_prompts=2, warmup=1, decoder=decoder))
    report = load_report(run_one("bench", recipe, head=str(head_dir), prompts=str(prompts_file)) / "report.json")
    assert report["lossless"] is True and report["hf_generate_token_agreement"] == 1.0
    assert report["tau"] > 1 and report["alpha"] > 0
    assert set(report["by_category"]) == {"chat", "code"}
