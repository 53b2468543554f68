#!/usr/bin/env python3
"""Render bench/results/*.json as Markdown tables (one row per op/shape/dtype, one column per
impl, ratios to "fuelgraph"): python bench/report.py [files...] >> BENCHMARKS.md"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(path: Path):
    doc = json.loads(path.read_text())
    if isinstance(doc, list):
        return {"records": doc}
    return doc


def table(doc) -> str:
    recs = [r for r in doc["records"] if "ms" in r]
    impls = list(dict.fromkeys(r["impl"] for r in recs))
    rows: dict = {}
    for r in recs:
        rows.setdefault((r["op"], "x".join(map(str, r["shape"])), r["dtype"]), {})[r["impl"]] = r
    out = ["| op | shape | dtype | " + " | ".join(impls) + " |",
           "|---|---|---|" + "---|" * len(impls)]
    for (op, shape, dtype), by in rows.items():
        base = by.get("fuelgraph", {}).get("ms")
        cells = []
        for i in impls:
            r = by.get(i)
            if r is None:
                cells.append("")
                continue
            c = f"{r['ms']:.3f}"
            if base and i != "fuelgraph":
                c += f" ({r['ms'] / base:.2f}x)"
            if "gbps" in r:
                c += f", {r['gbps']:.0f} GB/s"
            if "tflops" in r:
                c += f", {r['tflops']:.0f} TFLOP/s"
            if "peak_extra_mib" in r:
                c += f", peak +{r['peak_extra_mib']:.0f} MiB"
            cells.append(c)
        out.append(f"| {op} | {shape} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv):
    paths = [Path(a) for a in argv] or sorted(RESULTS.glob("*.json"))
    for p in paths:
        doc = load(p)
        head = f"### {p.name}"
        meta = ", ".join(f"{k}: {doc[k]}" for k in ("machine", "date", "command") if k in doc)
        print(head + ("\n" + meta if meta else "") + "\n\n" + table(doc) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
