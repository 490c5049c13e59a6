"""Conversations -> chat-templated token ids with an assistant loss mask.

The loss mask covers exactly the tokens the verifier generates in an assistant turn: the answer
(and any reasoning the template renders inside the turn) plus the end-of-turn token. It is exact
for any template:
- templates with `{% generation %}` markers: transformers' own assistant mask;
- otherwise: each assistant turn's span is the text between the rendering of the conversation up
  to that turn with the generation prompt, and the rendering that includes the turn (trailing
  whitespace after the end-of-turn token excluded, the model never generates it). Templates that
  rewrite history (drop earlier reasoning) fall back to locating the answer text itself.
"""
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
TOOL_ROLES = {"tool", "function", "function_call", "observation", "ipython", "tool_call", "tool_response"}


class Skip(Exception):
    """A conversation that is dropped and counted under `reason` (documented in the README)."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class BadRecord(Exception):
    """A record that breaks the input contract: the stage stops with file, record and fix."""


def _text(content):
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content):
            return "".join(parts)
        raise Skip("non_text_content")
    if content is None:
        return ""
    raise BadRecord(f"message content must be a string, got {type(content).__name__}")


def normalize(record, max_turns=0):
    """Record in ShareGPT or OpenAI form -> list of {"role", "content"}; raises Skip or BadRecord."""
    if not isinstance(record, dict):
        raise BadRecord(f"record must be a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns, rk, ck = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, rk, ck = record["messages"], "role", "content"
    else:
        raise BadRecord("record has neither 'conversations' (ShareGPT: from/value) nor 'messages' "
                        "(OpenAI: role/content)")
    if not isinstance(turns, list):
        raise BadRecord(f"'{'conversations' if rk == 'from' else 'messages'}' must be a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or rk not in turn:
            raise BadRecord(f"each turn needs a '{rk}' field (and '{ck}')")
        role = str(turn[rk]).lower()
        if role in TOOL_ROLES:
            raise Skip("tool_role")
        if role not in ROLE_MAP:
            raise Skip("unknown_role")
        messages.append({"role": ROLE_MAP[role], "content": _text(turn.get(ck))})
    return trim(messages, max_turns)


def trim(messages, max_turns=0):
    """Drop leading assistant turns and empty turns; keep up to `max_turns` user turns with answers."""
    if not messages:
        raise Skip("empty")
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = [m for m in messages[len(system):] if m["role"] != "system"]
    while rest and rest[0]["role"] != "user":
        rest.pop(0)
    out, users = [], 0
    for m in rest:
        if m["role"] == "user":
            if max_turns and users == max_turns:
                break
            users += 1
        if out and out[-1]["role"] == m["role"]:  # merge consecutive same-role turns
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n" + m["content"]}
        else:
            out.append(dict(m))
    while out and out[-1]["role"] != "assistant":
        out.pop()
    if not out:
        raise Skip("no_assistant")
    if any(not m["content"].strip() for m in out):
        raise Skip("empty_turn")
    return system + out


def render(tok, messages, add_generation_prompt=False):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tok, messages, text):
    """Character spans [start, end) of each assistant turn inside `text` (= render(messages))."""
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(tok, messages[:i], add_generation_prompt=True)
        upto = render(tok, messages[:i + 1])
        if text.startswith(upto) and upto.startswith(prefix) and len(prefix) >= cursor:
            start, end = len(prefix), len(upto.rstrip())
        else:  # template rewrites history (drops earlier reasoning): header .. end-of-turn marker
            start, end = _span_by_markers(tok, messages, i, upto, text, cursor)
        spans.append((start, end))
        cursor = end
    return spans


def _span_by_markers(tok, messages, i, upto, text, cursor):
    header = render(tok, messages[:i], add_generation_prompt=True)[len(render(tok, messages[:i])):]
    content = messages[i]["content"]
    eot = upto[upto.rfind(content) + len(content):].strip() if content in upto else ""
    pos = text.find(header, cursor) if header else -1
    stop = text.find(eot, pos + len(header)) if eot and pos >= 0 else -1
    if stop < 0:
        raise Skip("template_drift")
    return pos + len(header), stop + len(eot)


def tokenize_conversation(tok, messages, max_seq_len):
    """-> (input_ids, loss_mask, truncated). Raises Skip when nothing trainable remains."""
    try:
        text = render(tok, messages)
    except Exception:  # jinja errors such as "roles must alternate"
        raise Skip("template_error")
    if "{% generation %}" in (tok.chat_template or "") or "{%- generation %}" in (tok.chat_template or ""):
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    else:
        spans = assistant_spans(tok, messages, text)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
    truncated = len(ids) > max_seq_len
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    if not any(mask):
        raise Skip("no_assistant_after_truncation" if truncated else "no_assistant_tokens")
    return ids, mask, truncated
