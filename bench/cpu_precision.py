#!/usr/bin/env python3
"""bf16 against fp32 on this CPU: the matmul probe behind --dtype auto / --amp auto, then vLLM generation
(the embedded SmolLM2, MT-bench first turns, greedy) in each dtype. Prints one line per figure.

  python bench/cpu_precision.py --prompts 32 --max-new-tokens 64

For the training step in each precision: bench/train_throughput.py --skip-speculators --amp off|bf16.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.precision import BF16_MIN_SPEEDUP, cpu_identity, measure_bf16_speedup  # noqa: E402


def generate(model_dir, dtype, prompts, new_tokens):
    import os

    from vllm import LLM, SamplingParams

    from common.engine import close_llm
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    t0 = time.time()
    llm = LLM(model_dir, dtype=dtype, enforce_eager=True, max_model_len=1024, seed=0)
    start = time.time() - t0
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    llm.chat(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.time()
    outs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.time() - t0
    close_llm(llm)
    return start, sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    print(f"cpu: {cpu_identity()}")
    for r in range(3):
        m = measure_bf16_speedup()
        print(f"probe {r + 1}: fp32 {m['fp32_gflops']} GFLOP/s, bf16 {m['bf16_gflops']} GFLOP/s, bf16/fp32 "
              f"{m['speedup']}x -> {'bf16' if m['speedup'] >= BF16_MIN_SPEEDUP else 'fp32'}")
    if args.skip_vllm:
        return
    from common.models import resolve_verifier
    from common.sources import mtbench_questions
    model_dir = resolve_verifier("embedded:smollm2-135m-instruct")
    prompts = [[{"role": "user", "content": turns[0]}] for _, turns, _ in mtbench_questions()[:args.prompts]]
    for dtype in ("float32", "bfloat16"):
        start, tps = generate(model_dir, dtype, prompts, args.max_new_tokens)
        print(f"vLLM {dtype}: engine start {start:.1f} s, generation {tps:.1f} tokens/s "
              f"({args.prompts} prompts x {args.max_new_tokens} tokens, greedy)")


if __name__ == "__main__":
    main()
