"""The draft models, by concern:

  layers     RMSNorm, RoPE, SwiGLU MLP, row-rounded Linear (both methods)
  eagle3     the EAGLE-3 / EAGLE-3.1 draft (one decoder layer, training-time test)
  ttt_plan   EAGLE-3's TTT row plan and its attention (per document on CPUs, flex attention on CUDA)
  dflash     the DFlash block draft (non-causal block attention over the context)
  losses     EAGLE-3's TTT KL loss; DFlash's per-slot loss and weights
  acceptance acceptance length, a block's per-slot counts
"""
