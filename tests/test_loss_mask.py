"""Golden loss-mask tests on three chat-template families, with the real SmolLM2 tokenizer.

The mask must cover exactly what the verifier generates in each assistant turn: the answer and
the end-of-turn token, nothing of the prompt, the role header or the newline after the turn.
"""
import copy

import pytest

from common.chat import Skip, normalize, tokenize_conversation

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Kimi-K2 style role markers
KIMI = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
# DeepSeek-R1 style: reasoning of earlier turns is dropped from the history (template rewrites history)
DEEPSEEK = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% if '</think>' in c and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<｜Assistant｜>{{ c }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
SPECIALS = {
    "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "kimi": ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"],
    "deepseek": ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
}

SINGLE = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 is 4."}]
MULTI = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
         {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red, or green."}]


def with_template(tok, name):
    tok = copy.deepcopy(tok)
    if name != "chatml":
        tok.add_special_tokens({"additional_special_tokens": SPECIALS[name]})
        tok.chat_template = {"llama3": LLAMA3, "kimi": KIMI, "deepseek": DEEPSEEK}[name]
    return tok


def masked_pieces(tok, msgs):
    """Decoded text of each contiguous run of loss-masked tokens."""
    ids, mask, _ = tokenize_conversation(tok, msgs, 4096)
    runs, cur = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


@pytest.mark.parametrize("name,eot", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("kimi", "<|im_end|>"),
                                      ("deepseek", "<｜end▁of▁sentence｜>")])
def test_single_and_multi_turn_golden(tokenizer, name, eot):
    tok = with_template(tokenizer, name)
    assert masked_pieces(tok, SINGLE) == [f"2+2 is 4.{eot}"]
    assert masked_pieces(tok, MULTI) == [f"Blue.{eot}", f"Red, or green.{eot}"]


def test_reasoning_kept_in_last_turn_and_history_rewrite(tokenizer):
    tok = with_template(tokenizer, "deepseek")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>greet</think>Hello!"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"}]
    eot = "<｜end▁of▁sentence｜>"
    # the earlier turn's reasoning is gone from the rendering, the last turn keeps it, as at serving time
    assert masked_pieces(tok, msgs) == [f"Hello!{eot}", f"<think>add</think>4{eot}"]


def test_chatml_mask_excludes_header_and_trailing_newline(tokenizer):
    ids, mask, _ = tokenize_conversation(tokenizer, SINGLE, 4096)
    text_unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert text_unmasked.endswith("<|im_start|>assistant\n\n")  # header masked out, final newline too
    assert "What is 2+2?" in text_unmasked


def test_truncation_policy(tokenizer):
    ids, mask, truncated = tokenize_conversation(tokenizer, SINGLE, 4096)
    short_ids, short_mask, was = tokenize_conversation(tokenizer, SINGLE, len(ids) - 3)
    assert was and short_ids == ids[:len(ids) - 3] and short_mask == mask[:len(ids) - 3]
    first_assistant = mask.index(1)
    with pytest.raises(Skip, match="no_assistant_after_truncation"):
        tokenize_conversation(tokenizer, SINGLE, first_assistant)


def test_normalize_sharegpt_and_openai_forms():
    share = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                               {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]}
    openai = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert normalize(share) == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert normalize(share, max_turns=1) == normalize(openai)
    with pytest.raises(Skip, match="tool_role"):
        normalize({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}]})
    with pytest.raises(Skip, match="no_assistant"):
        normalize({"messages": [{"role": "user", "content": "a"}]})
