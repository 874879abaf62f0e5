"""``python -m p2pkv.tools.proxy --prefill HOST:PORT ... --decode HOST:PORT ...``."""

from __future__ import annotations

import argparse
import sys

from p2pkv.tools.proxy.proxy_cli import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m p2pkv.tools.proxy",
                                     description="The p2pkv OpenAI-compatible prefill/decode proxy.")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
