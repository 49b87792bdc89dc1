#!/usr/bin/env python
"""Write a small random Kimi-K2 checkpoint in one of the real layouts (for tests and CPU end-to-end runs).

    python tools/make_tiny_checkpoint.py OUT_DIR [--layout k2.6|k2-thinking|k2-instruct] [--seed N]
                                         [--tokenizer-dir DIR | --builtin-tokenizer] [--eagle3-draft DIR]

The layouts, dimensions and weight scheme: kimi/tiny_checkpoint.py, which this command line runs.
"""

import sys

from kimi.tiny_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
