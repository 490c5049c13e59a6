#!/usr/bin/env python3
"""Stage placeholder: not implemented yet (see the open issues)."""
import sys

if __name__ == "__main__":
    print("error: 04_train.py is not implemented yet", file=sys.stderr)
    sys.exit(2)
