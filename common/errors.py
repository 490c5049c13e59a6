"""User-facing failures: one line on stderr, exit status 2, no traceback."""
import signal
import sys


def first_line(exc, limit=200):
    """An exception's first line for a one-line error (its type where it has no text)."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


class UsageError(Exception):
    """Bad arguments, input files or stage hand-offs: the user can fix it; exit 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill PID` of a nohup'd stage), unwound like Ctrl-C, so that vLLM's shutdown runs at exit and
    its engine processes go with us (with Python's default action they stayed, busy and holding memory)."""


def _on_sigterm(signum, frame):
    raise Terminated


def run_main(main):
    """Run a stage's main(); turn UsageError into a one-line error and exit status 2."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = main()
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        how = "terminated" if isinstance(exc, Terminated) else "interrupted"
        print(f"{how}; finished work is kept, re-run the same command to resume", file=sys.stderr, flush=True)
        sys.exit(143 if how == "terminated" else 130)
    sys.exit(code or 0)
