#!/usr/bin/env python3
"""Stall reasons of an `ncu --page source --csv --print-source sass` export, split by how many warps executed each
SASS instruction: code that only the routing block runs (executed by at most one block's warps) against the rest.
Answers whether the routing pass waits on the instruction stream (stall_no_inst) or on memory (stall_long_sb).

    ncu-stalls.py ncu-source-sass.csv [--warps-per-block 16]
"""
import argparse
import csv


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--warps-per-block", type=int, default=16)
    args = parser.parse_args()
    rows = list(csv.reader(open(args.csv)))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header, data = rows[header_at], [r for r in rows[header_at + 1:] if len(r) == len(rows[header_at])]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    groups = {"one block (routing)": {}, "all blocks": {}}
    for r in data:
        executed = number(r[col["Instructions Executed"]])
        if executed == 0:
            continue
        group = groups["one block (routing)" if executed <= 4 * args.warps_per_block else "all blocks"]
        for reason in reasons:
            group[reason] = group.get(reason, 0.0) + number(r[col[reason]])
    for name, totals in groups.items():
        total = sum(totals.values())
        top = sorted(totals.items(), key=lambda kv: -kv[1])[:6]
        print(f"{name}: {total:.0f} samples; " +
              ", ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in top if total > 0))


if __name__ == "__main__":
    main()
