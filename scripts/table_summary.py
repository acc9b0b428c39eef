"""Per-bucket results of a tuned table as Markdown: winner, vLLM's pick, speedups, served.

Usage: python scripts/table_summary.py TABLE [--configs DIR]
``--configs``: vLLM's tuned-config folder to take as today's rule (sets
``VLLM_TUNED_CONFIG_FOLDER``); rows are judged for the table's own SKU.
"""

from __future__ import annotations

import argparse
import os

from moetune import db


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("table")
    parser.add_argument("--configs")
    args = parser.parse_args()
    if args.configs:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = os.path.realpath(args.configs)
    from moetune.runtime.platform import SKU
    from moetune.tuner.report import speedup_markdown

    snapshot = db.read_winners(args.table)
    sku = SKU.from_row(snapshot.skus[0])
    print(speedup_markdown(snapshot, sku))


if __name__ == "__main__":
    main()
