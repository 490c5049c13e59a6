#!/usr/bin/env python3
"""Write the miniature Kimi-K2.5 (random weights, the real checkpoint's structure) to --out DIR.

  python scripts/mini_kimi.py --out DIR [--tokenizer DIR]

The pipeline builds the same model on demand for `--verifier embedded:kimi-k2.5-mini` (cached under
~/.cache/eagle3-train or $EAGLE3_CACHE); this script is for using it elsewhere, e.g. on a GPU node
without the packaged SmolLM2 (pass any folder holding SmolLM2's tokenizer files as --tokenizer).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.mini_kimi import write_mini_kimi  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to write (replaced if it exists)")
    ap.add_argument("--tokenizer", default="", help="folder with SmolLM2's tokenizer (default: the embedded one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = args.tokenizer
    if not tok:
        from common.models import resolve_verifier
        tok = resolve_verifier("embedded:smollm2-135m-instruct")
    print(write_mini_kimi(args.out, tok, args.seed))


if __name__ == "__main__":
    main()
