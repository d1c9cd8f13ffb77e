"""One line per checkpoint and cache state from bench_load.py's --out JSON: each loader's best and
first seconds (and the median of several), and the ceilings; per cold row with the disk's
counters, a line per loader: the disk's rate while busy, its mean request and queue (medians).
`python bench/summarize_load.py load.json [...]`"""

from __future__ import annotations

import json
import statistics
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
                    several = len(value.get("all_seconds", [])) > 1
                    extra = f" (median {value['median_seconds']:.3f}, first {value['first_seconds']:.3f})" \
                        if several else ""
                    parts.append(f"{key} {value['seconds']:.3f}{extra}")
                elif isinstance(value, dict) and "error" in value:
                    parts.append(f"{key} error: {value['error'][:80]}")
                elif key.endswith("GBps"):
                    parts.append(f"{key} {value:.2f}")
            verify = row.get("wcd_verify")
            if isinstance(verify, dict):
                parts.append(f"verify {verify['seconds']:.3f} s match={verify['match']}")
            print(" ".join(parts))
            seen: dict[str, list[dict[str, float]]] = {}
            for d in row.get("disk", []):
                if d.get("busy_s"):
                    seen.setdefault(d["loader"], []).append(d)
            for loader, ds in seen.items():
                print(f"  {loader}: disk {statistics.median(d['MB'] / 1e3 / d['busy_s'] for d in ds):.2f} GB/s "
                      f"while busy ({statistics.median(d['busy_of_wall'] for d in ds):.0%} of the clock), "
                      f"{statistics.median(d['KiB_per_read'] for d in ds):.0f} KiB per request, "
                      f"queue {statistics.median(d['mean_queue'] for d in ds):.1f} ({len(ds)} loads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
