#!/usr/bin/env python3
"""fxmega's entry point: ``python run.py --config configs/tiny_gpt.py`` (see README.md)."""

import sys

from fxmega.cli import main

if __name__ == "__main__":
    sys.exit(main())
