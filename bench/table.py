#!/usr/bin/env python3
"""Merges the --json lines of torchpoint_bench and bench/peers.py into one Markdown table.

    python bench/table.py CPP.jsonl PEERS.jsonl > table.md
    python bench/table.py build/interleaved.jsonl     (bench/interleaved.sh's records)

For each state and operation, one row per system with its median seconds and GB/s, its ratio to
the fastest peer (the systems a user would otherwise pick: torch::save/load, torch.save/load,
safetensors, dcp, dcp-async, accelerate) and to the machine's limit measured in the same run
(O_DIRECT write + fsync for saves, read() into new memory for loads, pread() into existing
memory for loads into a model). Lines of other shapes (the J section) are skipped. Several
records of one (state, op, system), as bench/interleaved.sh makes one per round, give their
median, with the min-max and the count in a last column (and the largest peak_extra_mib).
"""

import json
import sys

PEERS = {"torch::save", "torch::load", "torch.save", "safetensors", "dcp", "dcp-async",
         "accelerate"}
LIMIT = {"save": "o_direct", "load": "read", "load_into": "pread"}
OPS = ["save", "load", "load_into"]


def read(paths):
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                row = json.loads(line)
                if {"state", "op", "system", "seconds", "bytes"} <= row.keys():
                    rows.append(row)
    return rows


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def aggregate(rows):
    """One row per (state, op, system): the median of its seconds (and stall) over the records,
    with the min and max; a single record stays as it is."""
    groups = {}
    for r in rows:
        groups.setdefault((r["state"], r["op"], r["system"]), []).append(r)
    out = []
    for (state, op, system), group in groups.items():
        seconds = [g["seconds"] for g in group]
        row = dict(group[0])
        row["seconds"] = median(seconds)
        row["min"], row["max"], row["n"] = min(seconds), max(seconds), len(seconds)
        stalls = [g["stall_seconds"] for g in group if "stall_seconds" in g]
        if stalls:
            row["stall_seconds"] = median(stalls)
        peaks = [g["peak_extra_mib"] for g in group if g.get("peak_extra_mib") is not None]
        if peaks:
            row["peak_extra_mib"] = max(peaks)
        out.append(row)
    return out


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    rows = aggregate(read(argv[1:]))
    spread = any(r["n"] > 1 for r in rows)
    print("| state | op | system | s | GB/s | / fastest peer | / disk limit |"
          + (" min-max s (n) |" if spread else ""))
    print("|---|---|---|---:|---:|---:|---:|" + ("---:|" if spread else ""))
    for state in sorted({r["state"] for r in rows}):
        for op in OPS:
            here = [r for r in rows if r["state"] == state and r["op"] == op]
            if not here:
                continue
            peers = [r["seconds"] for r in here if r["system"] in PEERS]
            fastest = min(peers) if peers else None
            limit_rows = [r for r in here if r["system"] == LIMIT[op]]
            limit = limit_rows[0]["seconds"] if limit_rows else None
            for r in sorted(here, key=lambda r: r["seconds"]):
                s = r["seconds"]
                gbps = r["bytes"] / s / 1e9 if s > 0 else float("nan")
                name = r["system"]
                if "stall_seconds" in r:
                    name += f" (stall {r['stall_seconds']:.3f} s)"
                to_peer = f"{s / fastest:.2f}" if fastest else "-"
                to_limit = f"{s / limit:.2f}" if limit else "-"
                line = f"| {state} | {op} | {name} | {s:.3f} | {gbps:.2f} | {to_peer} | {to_limit} |"
                if spread:
                    line += f" {r['min']:.3f}-{r['max']:.3f} ({r['n']}) |"
                print(line)


if __name__ == "__main__":
    main(sys.argv)
