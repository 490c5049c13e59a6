"""User-facing failures: one line on stderr, exit status 2, no traceback."""
import sys


class UsageError(Exception):
    """Bad arguments, input files or stage hand-offs: the user can fix it; exit 2."""


def run_main(main):
    """Run a stage's main(); turn UsageError into a one-line error and exit status 2."""
    try:
        code = main()
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted; finished work is kept, re-run the same command to resume", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
