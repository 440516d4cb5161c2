"""`mlx-dspark models`: the registry of target -> drafter pairs (and the demo model)."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list the registered target -> drafter pairs")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def _demo() -> dict | None:
    try:
        from ..models.demo import demo_info
    except ImportError:
        return None
    try:
        info = demo_info()
    except Exception as e:  # the demo module is optional; never break the table on it
        return {"error": f"{type(e).__name__}: {e}"}
    return info if isinstance(info, dict) else {"info": str(info)}


def _demo_line(d: dict) -> str:
    if "name" not in d:
        return ", ".join(f"{k}: {v}" for k, v in d.items())
    what = ", ".join(str(d[k]) for k in ("format", "package") if d.get(k))
    line = f"{d['name']}" + (f" ({what})" if what else "")
    if d.get("available") and d.get("path"):
        return f"{line}, at {d['path']}"
    return f"{line}, not fetched yet" + (f" ({d['fetch']})" if d.get("fetch") else "")


def run(args) -> int:
    from ..models.registry import table

    rows = table()
    demo = _demo()
    if args.json:
        print(json.dumps({"pairs": rows, "demo": demo}, ensure_ascii=False))
        return 0
    cols = [("target", "target"), ("mode", "mode"), ("drafter", "drafter"), ("publisher", "publisher"),
            ("drafts", "drafts_per_round"), ("measured by us", "measured")]
    blank = {"drafts_per_round": "config", "measured": "not yet"}
    cells = [[str(r[k]) if r[k] is not None else blank.get(k, "") for _, k in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(cols)]
    print("  ".join(h.ljust(w) for (h, _), w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for c, r in zip(cells, rows):
        line = "  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip()
        print(line + (f"  ({r['note']})" if r["note"] else ""))
    if any(r["measured"] is None for r in rows):
        print("\nNot yet measured: pairs published by DeepSeek / z-lab, to be measured with `mlx-dspark benchmark`.")
    print("Any -4bit / -8bit / bf16 repo of a listed target resolves the same drafter. "
          "--drafter REPO_OR_DIR runs any other compatible DSpark / DFlash checkpoint.")
    if demo is not None:
        print(f"demo model (used when --model is omitted): {_demo_line(demo)}; no drafter registered (auto = lookup)")
    return 0
