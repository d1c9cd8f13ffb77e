"""One line per checkpoint and cache state from bench_load.py's --out JSON: each loader's best and
first seconds, and the ceilings. `python bench/summarize_load.py load.json [...]`"""

from __future__ import annotations

import json
import sys


def main() -> int:
    for path in sys.argv[1:]:
        result = json.load(open(path))
        if "pinned_h2d_GBps" in result:
            print(f"{path}: pinned H2D {result['pinned_h2d_GBps']:.1f} GB/s")
        for row in result["runs"]:
            parts = [f"{row['gb']:.1f} GB/{row['tensors']} {row['mode']}:"]
            for key, value in row.items():
                if isinstance(value, dict) and "seconds" in value and key != "wcd_verify":
                    extra = f" (first {value['first_seconds']:.3f})" if len(value.get("all_seconds", [])) > 1 else ""
                    parts.append(f"{key} {value['seconds']:.3f}{extra}")
                elif isinstance(value, dict) and "error" in value:
                    parts.append(f"{key} error: {value['error'][:80]}")
                elif key.endswith("GBps"):
                    parts.append(f"{key} {value:.2f}")
            verify = row.get("wcd_verify")
            if isinstance(verify, dict):
                parts.append(f"verify {verify['seconds']:.3f} s match={verify['match']}")
            print(" ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
