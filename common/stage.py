"""Start-of-stage boilerplate shared by the numbered scripts."""
import faulthandler
import os
import signal
from pathlib import Path

from common.config import parse_config
from common.errors import UsageError
from common.log import setup_logging


def start(stage, name, description, argv=None):
    """Parse options (exit 2 on errors), set up logging, log the full resolved config."""
    cfg = parse_config(stage, description, argv)
    log = setup_logging(name)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to the log
    src = f" from {cfg.config_file}" if cfg.config_file else ""
    log.info("%s%s; resolved config%s:\n%s", name, " (dry run)" if cfg.dry_run else "", src, cfg.describe())
    return cfg, log


def ensure_writable(folder):
    """Create `folder` (and parents) or fail with the reason, before any expensive work."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_test.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write to {folder}: {exc.strerror}; choose another --work-dir")
    return folder
