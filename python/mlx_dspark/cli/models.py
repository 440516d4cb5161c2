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


WIDTH = 100  # the table fits a 100-column terminal; long cells wrap under their row


def _drafter_cell(path: str) -> str:
    """A drafter shipped inside the package shows as `package: NAME`, not as a long local path;
    one that is not distributed says so (its row's `make` line says how to make it)."""
    from pathlib import Path

    from ..models.registry import is_packaged

    if not path:
        return "not distributed (make it)"
    return f"package: {Path(path).name}" if is_packaged(path) else path


def _demo_drafter(demo: dict) -> str:
    from ..models.registry import AUTO_KINDS, pairs_for_name

    pairs = pairs_for_name(str(demo.get("name", "")))
    if not pairs:
        return "no drafter registered (auto = lookup)"
    auto = min(pairs, key=lambda p: AUTO_KINDS.index(p.kind))  # the first pair auto tries
    line = f"its registered {auto.kind} drafter runs in auto mode ({_drafter_cell(auto.drafter)})"
    others = [p for p in pairs if p.kind != auto.kind]
    return line + "".join(f", its {p.kind} drafter with --mode {p.kind} ({_drafter_cell(p.drafter)})" for p in others)


def run(args) -> int:
    import textwrap

    from ..models.registry import table

    rows = table()
    demo = _demo()
    if args.json:
        print(json.dumps({"pairs": rows, "demo": demo}, ensure_ascii=False))
        return 0
    cols = [
        ("target", "target"),
        ("mode", "mode"),
        ("drafts", "drafts_per_round"),
        ("drafter", "drafter"),
        ("publisher", "publisher"),
    ]
    cells = [
        [
            r["target"],
            r["mode"],
            str(r["drafts_per_round"] or "config"),
            _drafter_cell(r["drafter"]),
            r["publisher"].split(" (")[0],
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(cols)]
    print("  ".join(h.ljust(w) for (h, _), w in zip(cols, widths)).rstrip())
    print("  ".join("-" * w for w in widths))
    for c, r in zip(cells, rows):
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
        for label, key in (("measured", "measured"), ("reproduce", "reproduce"), ("make", "make"), ("note", "note")):
            if r[key]:
                print(textwrap.fill(f"{label}: {r[key]}", WIDTH, initial_indent="    ", subsequent_indent="      "))
    if any(r["measured"] is None for r in rows):
        print(
            textwrap.fill(
                "Rows without a 'measured' line are pairs published by DeepSeek / z-lab, not yet "
                "measured by us (`mlx-dspark benchmark --json` measures one).",
                WIDTH,
            )
        )
    print(
        textwrap.fill(
            "Any -4bit / -8bit / bf16 repo of a listed target resolves the same drafter. "
            "--drafter REPO_OR_DIR runs any other compatible DSpark / DFlash checkpoint.",
            WIDTH,
        )
    )
    if demo is not None:
        line = f"demo model (used when --model is omitted): {_demo_line(demo)}"
        if "name" in demo:
            line += f"; {_demo_drafter(demo)}"
        print(textwrap.fill(line, WIDTH, subsequent_indent="    "))
    return 0
