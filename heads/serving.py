"""What an export tells whoever serves it: the decoding settings (chain length K, a tree's shape) and the
SGLang / vLLM commands that load the draft with them.

The draft's path in SERVING.md is THIS_FOLDER, never the exporting machine's path: an export is moved,
copied and uploaded as it is (on the Hub the model card names the repo id instead).
"""

from __future__ import annotations

import json

DEFAULT_NUM_SPECULATIVE_TOKENS = 4
THIS_FOLDER = "<path to this folder>"


def decoding_settings(num_speculative_tokens: int | None = None, mode: str = "chain", depth: int | None = None,
                      topk: int = 1, budget: int | None = None, report: str | None = None) -> dict:
    """What the serving snippets need: chain length K, and the tree shape SGLang takes (chain: depth K, topk 1).

    `report` names the bench report the settings were measured in (None: defaults, said so in SERVING.md).
    """
    if mode not in ("chain", "tree"):
        raise ValueError(f"decoder mode '{mode}' is not chain or tree")
    k = int(num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS)
    settings = {"mode": mode, "num_speculative_tokens": k, "from_report": report is not None, "report": report}
    if mode == "tree":
        depth, topk, budget = int(depth or k), int(topk), int(budget or k)
        # SGLang counts the verified root token in num_draft_tokens and caps it at depth * topk + 1.
        settings.update(depth=depth, topk=topk, num_draft_tokens=min(budget + 1, depth * topk + 1))
    else:
        settings.update(depth=k, topk=1, num_draft_tokens=k + 1)
    return settings


def serving_snippets(target: str, draft: str, settings: dict) -> dict[str, str]:
    k = settings["num_speculative_tokens"]
    spec = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": k})
    return {
        "vllm": f"vllm serve {target} --speculative-config '{spec}'",
        "sglang": (f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
                   f"--speculative-draft-model-path {draft} --speculative-num-steps {settings['depth']} "
                   f"--speculative-eagle-topk {settings['topk']} "
                   f"--speculative-num-draft-tokens {settings['num_draft_tokens']}"),
        "speculators": f"vllm serve {draft}",
    }


def serving_markdown(fmt: str, target: str, draft: str, settings: dict) -> str:
    snippets = serving_snippets(target, draft, settings)
    order = {"sglang": ["sglang", "vllm"], "vllm": ["vllm", "sglang"], "speculators": ["speculators", "vllm"]}[fmt]
    titles = {"vllm": "vLLM", "sglang": "SGLang",
              "speculators": "vLLM, speculators format (the verifier is read from config.json)"}
    source = ("the best settings of the bench report" if settings.get("from_report")
              else "default chain settings (no bench report given)")
    lines = [f"Settings: {source}: mode {settings['mode']}, K={settings['num_speculative_tokens']}, "
             f"depth {settings['depth']}, topk {settings['topk']}, draft tokens {settings['num_draft_tokens']}.", ""]
    if draft == THIS_FOLDER:
        lines += [f"`{THIS_FOLDER}` stands for where this folder is on the serving machine (or its Hub repo id).", ""]
    for name in order:
        lines += [f"### {titles[name]}", "", "```bash", snippets[name], "```", ""]
    return "\n".join(lines)
