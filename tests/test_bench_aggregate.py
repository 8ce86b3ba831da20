"""The bench's arithmetic: pooled acceptance, conditional alpha per depth, latency percentiles, speedups."""

from __future__ import annotations

import numpy as np
import pytest

from eyas.eval.aggregate import (PromptResult, acceptance_figures, by_category, cost_model, inter_token_latencies,
                                 percentiles, predicted_speedup, speed_figures, speedup_interval, summarize,
                                 token_agreement)
from eyas.eval.bench import BenchPrompt
from eyas.eval.decoder import GenerationStats as Stats
from eyas.eval.report import plain_json


def test_tau_is_pooled_not_a_mean_of_per_prompt_means():
    # One short prompt with one lucky draft, one long prompt where nothing is accepted.
    lucky = Stats(tokens=[1] * 4, drafts=1, draft_tokens=3, accepted_tokens=3, target_forwards=2)
    unlucky = Stats(tokens=[1] * 9, drafts=9, draft_tokens=27, accepted_tokens=0, target_forwards=10)
    acc = acceptance_figures([lucky, unlucky])
    assert acc["tau"] == pytest.approx(1 + 3 / 10)  # vLLM: 1 + sum(accepted) / sum(drafts)
    assert acc["tau_mean_of_prompts"] == pytest.approx((4 + 1) / 2)
    assert acc["alpha"] == pytest.approx(3 / 30)
    assert acc["tokens_per_target_forward"] == pytest.approx(13 / 12)


def test_alpha_per_position_is_conditional_and_pooled_over_prompts_of_different_depths():
    a = Stats(tokens=[1], drafts=6, draft_tokens=18, accepted_tokens=6,
              accepted_per_position=[3, 2, 1], reached_per_position=[6, 3, 2])
    b = Stats(tokens=[1], drafts=4, draft_tokens=8, accepted_tokens=3,
              accepted_per_position=[2, 1], reached_per_position=[4, 2])
    acc = acceptance_figures([a, b])
    assert acc["accepted_per_position"] == [5, 3, 1]
    assert acc["reached_per_position"] == [10, 5, 2]
    assert acc["alpha_per_position"] == pytest.approx([0.5, 0.6, 0.5])
    # vLLM's per-position rate divides by all drafts, so it can only fall with depth.
    assert acc["acceptance_rate_per_position"] == pytest.approx([0.5, 0.3, 0.1])
    assert acc["alpha"] == pytest.approx(9 / 26)


def test_no_drafts_gives_no_tau_or_alpha_rather_than_a_made_up_number():
    acc = acceptance_figures([Stats(tokens=[1, 2], target_forwards=2)])
    assert acc["tau"] is None and acc["alpha"] is None and acc["alpha_per_position"] == []


def test_percentiles_match_numpy_linear_interpolation():
    values = list(range(1, 101))
    got = percentiles(values)
    assert got == {"p50": pytest.approx(50.5), "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert percentiles([0.002, 0.004], scale=1e3)["p50"] == pytest.approx(3.0)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_tokens_accepted_together_are_one_arrival_for_inter_token_latency():
    # Steps land at 0.1 (1 token), 0.3 (3 tokens), 0.6 (2 tokens).
    times = [0.1, 0.3, 0.3, 0.3, 0.6, 0.6]
    assert inter_token_latencies(times) == pytest.approx([0.2, 0.3])
    assert inter_token_latencies([0.5]) == []


def test_throughput_is_total_tokens_over_total_time_and_latency_pooled():
    fast = Stats(tokens=[1] * 10, token_times_s=[0.01 * (i + 1) for i in range(10)], ttft_s=0.01,
                 time_target_s=0.08, time_draft_s=0.0, time_other_s=0.02, target_forwards=10)
    slow = Stats(tokens=[1] * 2, token_times_s=[0.5, 1.0], ttft_s=0.5, time_target_s=0.9, time_other_s=0.1,
                 target_forwards=2)
    speed = speed_figures([fast, slow], [0.1, 1.0])
    assert speed["tokens_per_s"] == pytest.approx(12 / 1.1)  # not the mean of 100 and 2 tok/s
    assert speed["new_tokens"] == 12 and speed["target_forwards"] == 12
    itl = [0.01] * 9 + [0.5]
    assert speed["itl_ms"]["p99"] == pytest.approx(float(np.percentile(itl, 99)) * 1e3)
    assert speed["ttft_ms"]["p50"] == pytest.approx(255.0)
    assert speed["time_ms_per_token"]["target"] == pytest.approx(1e3 * 0.98 / 12)
    assert speed["tpot_ms"]["p50"] == pytest.approx(1e3 * ((0.1 - 0.01) / 9 + (1.0 - 0.5) / 1) / 2)


def test_predicted_speedup_follows_the_classic_formula():
    # alpha 0.5, K 3: (1 - 0.5^4) / 0.5 = 1.875 tokens per step.
    assert predicted_speedup(0.5, 3) == pytest.approx(1.875)
    assert predicted_speedup(0.5, 3, verify_cost=1.2, draft_cost=0.1) == pytest.approx(1.875 / 1.5)
    assert predicted_speedup(1.0, 4) == pytest.approx(5.0)
    assert predicted_speedup(0.0, 4, draft_cost=0.05) == pytest.approx(1 / 1.2)


def test_cost_model_takes_prefill_out_of_both_decoders():
    # Plain: prefill 0.2 s, then 10 steps of 0.01 s. Chain: same prefill, 4 verify steps of 0.012 s,
    # 8 draft forwards of 0.002 s, 0.004 s other overhead in total.
    plain = [Stats(tokens=[1] * 11, ttft_s=0.2, target_forwards=11)]
    chain = [Stats(tokens=[1] * 11, ttft_s=0.2, target_forwards=5, draft_tokens=8,
                   time_target_s=0.2 + 4 * 0.012, time_draft_s=8 * 0.002, time_other_s=0.004)]
    model = cost_model(plain, [0.3], chain, alpha=0.6, k=2)
    assert model["plain_step_ms"] == pytest.approx(10.0)
    assert model["verify_cost"] == pytest.approx(1.2)
    assert model["draft_cost"] == pytest.approx(0.2)
    assert model["other_cost"] == pytest.approx(0.1)
    # alpha = accepted / drafted, so a step of K=2 drafts yields 1 + 2 * 0.6 tokens on average.
    assert model["expected_tokens_per_step"] == pytest.approx(2.2)
    assert model["predicted_speedup"] == pytest.approx(2.2 / (1.2 + 2 * 0.2 + 0.1))
    assert model["predicted_speedup_independent"] == pytest.approx(predicted_speedup(0.6, 2, 1.2, 0.2, 0.1))


def _result(line, category, plain_tokens, spec_tokens, plain_wall, spec_wall, accepted, drafts):
    plain = Stats(tokens=plain_tokens, token_times_s=[0.01 * (i + 1) for i in range(len(plain_tokens))],
                  ttft_s=0.01, target_forwards=len(plain_tokens))
    spec = Stats(tokens=spec_tokens, token_times_s=[0.02 * (i // 2 + 1) for i in range(len(spec_tokens))],
                 ttft_s=0.01, drafts=drafts, draft_tokens=2 * drafts, accepted_tokens=accepted,
                 accepted_per_position=[accepted], reached_per_position=[drafts], target_forwards=drafts + 1)
    r = PromptResult(prompt=BenchPrompt(line=line, category=category, prompt="x"), prompt_tokens=5)
    r.stats = {"plain": plain, "spec": spec, "chain": spec}
    r.wall_s = {"plain": plain_wall, "spec": spec_wall}
    return r


def test_categories_are_summarised_separately_and_lossless_is_per_prompt():
    results = [
        _result(1, "chat", [5, 6, 7, 8], [5, 6, 7, 8], 1.0, 0.5, accepted=2, drafts=2),
        _result(2, "code", [1, 2, 3, 4], [1, 2, 3, 4], 1.0, 0.25, accepted=3, drafts=1),
        _result(3, "chat", [9, 9, 9, 9], [9, 9, 1, 1], 1.0, 1.0, accepted=0, drafts=4),
    ]
    overall = summarize(results, greedy=True, k_alpha=2)
    cats = by_category(results, greedy=True, k_alpha=2)
    assert set(cats) == {"chat", "code"}
    assert cats["code"]["speedup"] == pytest.approx(4.0)
    assert cats["chat"]["speedup"] == pytest.approx((8 / 1.5) / (8 / 2.0))
    assert overall["speedup"] == pytest.approx((12 / 1.75) / (12 / 3.0))
    assert cats["chat"]["tau"] == pytest.approx(1 + 2 / 6) and cats["code"]["tau"] == pytest.approx(4.0)
    assert cats["chat"]["prompts"] == 2
    assert overall["lossless"] is False and overall["lossless_prompts"] == 2
    assert cats["code"]["lossless"] is True and cats["chat"]["lossless"] is False
    assert overall["token_agreement"] == pytest.approx((1 + 1 + 0.5) / 3)
    # Without transformers runs there is nothing to compare against, and the report says so.
    assert overall["speedup_vs_hf_generate"] is None


def test_sampling_makes_no_losslessness_claim():
    results = [_result(1, "chat", [1, 2], [3, 4], 1.0, 1.0, accepted=0, drafts=1)]
    assert summarize(results, greedy=False, k_alpha=2)["lossless"] is None


def test_token_agreement_counts_the_prefix_before_the_first_divergence():
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 0.25
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 0.5


def test_plain_json_drops_non_finite_numbers():
    import torch

    assert plain_json({"a": float("nan"), "b": [np.float32(1.5), float("inf")], 3: np.int64(2)}) == \
        {"a": None, "b": [1.5, None], "3": 2}
    assert plain_json({"t": torch.tensor([0.5, float("nan")]), "ok": np.bool_(True)}) == {"t": [0.5, None], "ok": True}


def test_speedup_interval_brackets_the_pooled_speedup_and_narrows_when_prompts_agree():
    plain_tokens, plain_s = [100] * 8, [1.0] * 8
    noisy = speedup_interval([100] * 8, [0.25, 1.0] * 4, plain_tokens, plain_s)
    steady = speedup_interval([100] * 8, [0.5] * 8, plain_tokens, plain_s)
    assert noisy[0] < 1 / 0.625 < noisy[1]
    assert steady == pytest.approx([2.0, 2.0])
    assert speedup_interval([10], [1.0], [10], [1.0]) is None


def samples(wall_s, machine_busy_s, own_s):
    from eyas.eval.bench import CpuSample

    return CpuSample(0.0, 100.0, 10.0), CpuSample(wall_s, 100.0 + machine_busy_s, 10.0 + own_s)


def test_a_quiet_machine_and_steady_prompts_make_trustworthy_figures():
    from eyas.eval.bench import measurement_noise

    # 100 s of bench on 2 CPUs: the machine was busy 205 CPU-seconds, 200 of them this process's own threads.
    noise = measurement_noise(*samples(100.0, 205.0, 200.0), cpus=2, plain_s_per_token=[0.010, 0.011, 0.0105],
                              load_after=(2.0, 1.9, 1.5))
    assert noise["trustworthy"] is True and noise["warnings"] == []
    assert noise["cpus"] == 2 and noise["load_after"] == [2.0, 1.9, 1.5]
    assert noise["other_cpu_per_core"] == pytest.approx(0.025)  # (205 - 200) / 100 s / 2 CPUs
    assert noise["plain_ms_per_token_cv"] == pytest.approx(np.std([10, 11, 10.5]) / 10.5)


def test_what_this_process_ran_before_the_bench_does_not_count_as_load():
    """In `eyas run` the train stage keeps both cores busy just before the bench: the 1-minute load average
    is then ~2 while nobody else runs. Counting CPU time from the bench's start sees no other process."""
    from eyas.eval.bench import measurement_noise

    noise = measurement_noise(*samples(300.0, 590.0, 588.0), cpus=2, plain_s_per_token=[0.01, 0.01],
                              load_after=(1.99, 1.9, 1.8))
    assert noise["trustworthy"] is True and noise["other_cpu_per_core"] == pytest.approx(2 / 300 / 2)


def test_other_processes_competing_for_the_cpus_mark_the_figures_untrustworthy():
    from eyas.eval.bench import measurement_noise

    # Another job took one core for the whole bench: 100 of the 200 busy CPU-seconds were not ours.
    noise = measurement_noise(*samples(100.0, 200.0, 100.0), cpus=2, plain_s_per_token=[0.01, 0.01])
    assert noise["trustworthy"] is False and len(noise["warnings"]) == 1
    assert "other processes used 0.50 of each of the 2 CPUs" in noise["warnings"][0]


def test_a_large_run_to_run_spread_or_inconsistent_layout_timings_mark_the_figures_untrustworthy():
    from eyas.eval.bench import measurement_noise

    quiet = samples(100.0, 200.0, 200.0)
    noise = measurement_noise(*quiet, cpus=2, plain_s_per_token=[0.01, 0.03, 0.01])
    assert noise["trustworthy"] is False and "spread" in noise["warnings"][0]
    noise = measurement_noise(*quiet, cpus=2, plain_s_per_token=[0.01, 0.01],
                              layout_warnings=["12 rows: inconsistent timings"])
    assert noise["trustworthy"] is False and "12 rows" in noise["warnings"][0]
    # No CPU accounting (a platform without /proc/stat): nothing claimed about the load.
    noise = measurement_noise(None, None, cpus=2, plain_s_per_token=[0.01, 0.01])
    assert noise["trustworthy"] is True and noise["other_cpu_per_core"] is None
