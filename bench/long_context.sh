#!/usr/bin/env bash
# Issue 51's table (docs/long-context.md): served acceptance of a finished run's draft by context length, on
# mtbench-long at the verifier's 8,192 positions (each MT-bench first turn alone, after ~3.4K and ~7.5K tokens of
# earlier conversation). Stage 5 writes WORK_DIR/eval/; the results are then copied to WORK_DIR/eval-long/.
#   bench/long_context.sh runs/smollm2-135m [more 05_evaluate.py options]
set -euo pipefail
work=${1:?usage: bench/long_context.sh WORK_DIR [05_evaluate.py options]}
shift
cd "$(dirname "$0")/.."
.venv/bin/python 05_evaluate.py --config configs/smollm2-135m.yaml --work-dir "$work" --eval-dataset mtbench-long \
    --max-seq-len 8192 --latency-prompts 0 "$@"
mkdir -p "$work/eval-long"
cp "$work"/eval/acceptance.json "$work"/eval/acceptance.md "$work/eval-long/"
.venv/bin/python - "$work/eval-long/acceptance.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for row in r["results"]:
    b = row["breakdown"] or {}
    print(f"k={row['num_speculative_tokens']}: acceptance length {row['acceptance_length']:.3f}, outputs equal "
          f"{row['outputs_equal_baseline']}/{row['prompts']}")
    for key in ("by_context", "by_category"):
        print(f"  {key}: " + ", ".join(f"{g} {v['acceptance_length']:.3f} ({v['drafts']} steps)"
                                      for g, v in b.get(key, {}).items()))
print("serve:", r["serve"]["why"])
PY
