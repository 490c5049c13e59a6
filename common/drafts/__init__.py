"""The draft methods and the code they share, by concern:

  interface  the interface every method implements (DraftMethod)
  eagle3     EAGLE-3 / EAGLE-3.1: one decoder layer, trained by the TTT unroll (model, loss, export, serving)
  dflash     DFlash: a block drafted per forward by a non-causal stack (model, loss, export, serving)
  ttt_plan   EAGLE-3's row plan and its attention (per document on CPUs, flex attention on CUDA)
  block_plan DFlash's block attention (per document on CPUs, flex attention on CUDA)
  layers     RMSNorm, RoPE, SwiGLU MLP, row-rounded Linear (both methods)
  losses     the soft-target KL kernel (EAGLE-3's default loss); the other --loss kinds; block drafts' slot weights
  acceptance acceptance length from per-position counts

The registry: method(name) -> that method's DraftMethod. Another method is one module defining METHOD, registered
with register(name, module), or named in EAGLE3_DRAFT_METHODS (comma-separated modules, imported on first lookup)
so that the stage scripts find it without an edit here.
"""
import importlib
import os

# name -> the module defining METHOD (imported on first use: a method pulls in torch and its model)
MODULES = {"eagle3": "common.drafts.eagle3", "dflash": "common.drafts.dflash"}
METHOD_NAMES = list(MODULES)  # --draft-method's choices (common/config.py reads this list)
LOSSES = ("kl", "ce", "tv", "nla", "lk")  # --loss's choices (losses.row_loss); speculators' kl_div, ce, tv, nla, lk_hybrid


def register(name, module):
    MODULES[name] = module
    if name not in METHOD_NAMES:
        METHOD_NAMES.append(name)


def _plugins():
    for module in filter(None, os.environ.get("EAGLE3_DRAFT_METHODS", "").split(",")):
        importlib.import_module(module)  # it calls register(); a second import is a no-op


_plugins()


def method(name):
    """The DraftMethod registered as `name`."""
    return importlib.import_module(MODULES[name]).METHOD


DEFAULT = "eagle3"  # where a config or a manifest predates --draft-method


def method_of(cfg):
    """The method a config, or stage 4's manifest params (a dict), names with draft_method."""
    name = cfg.get("draft_method") if isinstance(cfg, dict) else getattr(cfg, "draft_method", None)
    return method(name or DEFAULT)


def method_of_export(conf):
    """The method whose export an exported config.json is (EAGLE-3 where none claims it: its EAGLE layout has no
    method field)."""
    for name in MODULES:
        m = method(name)
        if name != DEFAULT and m.exports(conf):
            return m
    return method(DEFAULT)
