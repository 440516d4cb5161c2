"""More training prompts for the reference drafter, made here, from nothing but this Python.

  python bench/make_prompts.py --out DIR [--code 4000] [--chat 3000] [--chat-kinds 0] [--seed 0]
                               [--packages numpy ...]

The shared train/ set has 1.2k code prompts and 750 chat prompts: too few for a drafter to learn
the target's code and chat well (its acceptance on the eval sets stays well below that on its
training batches). This
writes more prompt files in the `{"turns": [...]}` format of shared/data/prompts:

- `code-stdlib.jsonl`: programming requests built from the public functions and methods of the
  Python standard library, read with `ast` (nothing is imported): a signature and its
  docstring, asked for in the ways users ask for code (a stub to complete, "write a function
  to ...", a named function with its signature);
- `code-packages.jsonl` (with `--packages numpy ...`): the same from installed packages;
- `code-files.jsonl` (with `--code-files N`): excerpts of those source files (12-48 lines from a
  `def`, `class` or decorator line) to continue: for a base model fed raw code (`--raw-code`), real
  code of every kind rather than one stub after another;
- `chat-topics.jsonl`: writing, explaining, advising, comparing and role-play requests over a
  list of everyday and academic topics;
- `chat-kinds.jsonl` (with `--chat-kinds N`): role-play, reasoning puzzles, school mathematics,
  extraction from a given text, STEM and humanities questions, rewriting a given passage
  (bench/chat_prompts.py).

The target answers them itself (`mlx-dspark distill --prompts ...`), so only their variety
matters, not their quality. No prompt equals one of shared/data/prompts/eval/ (checked when that
folder is there).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_prompts import kind_prompts  # noqa: E402

SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
    "site-packages",
    "ensurepip",
    "pydoc_data",
    "__pycache__",
    "dist-packages",
    "config-3",
    "venv",
}

STUB_ASKS = [
    "Complete the following Python function.",
    "Implement the function below.",
    "Fill in the body of this function:",
    "Write the implementation of this Python function, then explain it briefly.",
    "Write a solution to the following problem and make sure that it passes the tests:",
]
SUMMARY_ASKS = [
    "Write a python function to {s}.",
    "Write a function to {s}.",
    "Write a Python function that can {s}.",
    "How would I {s} in Python? Write a function for it.",
]
NAMED_ASK = "Write a python function `{name}({args})` that {s_3rd}."

CHAT_ASKS = [
    "Write a blog post about {t}.",
    "Compose an engaging travel-style blog post about {t}, highlighting what most people miss.",
    "Explain {t} to a high school student.",
    "Explain {t} in simple terms, then give one surprising fact about it.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a persuasive email to your manager about {t}.",
    "Draft a short, professional email asking a colleague for feedback on a report about {t}.",
    "Describe {t} in three short paragraphs.",
    "Give me five practical tips related to {t}.",
    "Write a short story in which {t} plays a central role.",
    "Write a poem about {t}.",
    "Summarize the history of {t} in a few paragraphs.",
    "Compare {t} and {u}: how are they alike and how do they differ?",
    "Draft a speech about {t} for a school assembly.",
    "Imagine you are an expert on {t}. What is the most common misconception about it, and why is it wrong?",
    "Pretend you are a tour guide. Introduce {t} to a group of visitors.",
    "Write a dialogue between two friends who disagree about {t}.",
    "What questions should I ask before making a decision about {t}?",
    "Create a one-week plan for learning about {t}.",
    "Write a product description for a book about {t}.",
    "List the key terms someone needs to understand {t}, with a one-line definition each.",
    "Write a critical review of a documentary about {t}.",
    "How might {t} change over the next twenty years?",
    "Write a short opinion piece arguing that {t} deserves more attention.",
    "What are the ethical questions raised by {t}?",
    "Write a limerick about {t}, then explain the joke.",
    "Act as a career counselor: what jobs are related to {t}, and what skills do they need?",
    "Write the opening paragraph of a novel set in a world shaped by {t}.",
    "Give a step-by-step explanation of how {t} works.",
    "Write a social media post announcing an event about {t}.",
]
TOPICS = [
    "renewable energy",
    "urban gardening",
    "the history of the printing press",
    "remote work",
    "electric cars",
    "the water cycle",
    "volcanoes",
    "ancient Rome",
    "the Renaissance",
    "jazz music",
    "photosynthesis",
    "machine learning",
    "the stock market",
    "inflation",
    "climate change",
    "coral reefs",
    "space exploration",
    "the human immune system",
    "sleep",
    "meditation",
    "running a marathon",
    "learning a second language",
    "public libraries",
    "social media",
    "video games",
    "classical music",
    "street food",
    "coffee",
    "tea ceremonies",
    "the Silk Road",
    "the Industrial Revolution",
    "democracy",
    "the Olympic Games",
    "honeybees",
    "rainforests",
    "deserts",
    "the deep ocean",
    "black holes",
    "the Moon landing",
    "vaccines",
    "antibiotics",
    "the internet",
    "smartphones",
    "cryptocurrency",
    "small businesses",
    "minimalism",
    "recycling",
    "fast fashion",
    "public transport",
    "bicycles in cities",
    "national parks",
    "mountain hiking",
    "camping",
    "cooking at home",
    "vegetarian diets",
    "chess",
    "soccer",
    "basketball",
    "photography",
    "painting",
    "architecture",
    "skyscrapers",
    "bridges",
    "the French Revolution",
    "the Cold War",
    "the invention of the telephone",
    "artificial intelligence in medicine",
    "robots",
    "self-driving cars",
    "3D printing",
    "quantum computing",
    "the periodic table",
    "DNA",
    "evolution",
    "dinosaurs",
    "earthquakes",
    "hurricanes",
    "weather forecasting",
    "time management",
    "job interviews",
    "public speaking",
    "leadership",
    "teamwork",
    "negotiation",
    "personal finance",
    "saving for retirement",
    "buying a first home",
    "starting a podcast",
    "writing a novel",
    "poetry",
    "Shakespeare",
    "mythology",
    "fairy tales",
    "board games",
    "volunteering",
    "adopting a pet",
    "dog training",
    "cats",
    "birdwatching",
    "gardening",
    "houseplants",
    "the Great Wall of China",
    "the pyramids of Giza",
    "Venice",
    "Tokyo",
    "Iceland",
    "Kenya",
    "the Amazon river",
    "the Arctic",
    "Antarctica",
    "migration of birds",
    "nutrition",
    "exercise",
    "mental health",
    "friendship",
    "moving to a new city",
    "studying abroad",
    "online education",
    "homeschooling",
    "standardized tests",
    "museums",
    "theater",
    "film festivals",
    "animation",
    "comics",
    "fashion design",
    "perfume",
    "chocolate",
    "bread baking",
    "wine making",
    "farming",
    "fishing",
    "water scarcity",
    "air pollution",
    "plastic in the oceans",
    "nuclear power",
    "solar panels",
    "wind farms",
    "batteries",
    "the electric grid",
    "cybersecurity",
    "passwords",
    "open-source software",
    "the history of computing",
    "typewriters",
    "maps and navigation",
    "lighthouses",
    "trains",
    "airplanes",
    "submarines",
    "the postal service",
    "handwriting",
    "libraries of the ancient world",
    "calendars",
    "timekeeping",
    "the metric system",
    "probability",
    "prime numbers",
    "geometry in art",
    "origami",
    "knitting",
    "woodworking",
    "volcanic islands",
    "tides",
    "the northern lights",
    "comets",
    "a four-day work week",
    "universal basic income",
    "city planning",
    "tourism",
    "hotels",
    "restaurants",
]


def stdlib_files() -> list[Path]:
    return _py_files(Path(sysconfig.get_paths()["stdlib"]))


def package_files(packages: list[str]) -> list[Path]:
    out = []
    for name in packages:
        d = Path(sysconfig.get_paths()["purelib"]) / name
        if not d.is_dir():
            raise SystemExit(f"make_prompts: package {name!r} is not installed in {d.parent}")
        out += _py_files(d, root=d.parent)
    return out


def _py_files(top: Path, root: Path | None = None) -> list[Path]:
    root = root or top
    out = []
    for f in sorted(top.rglob("*.py")):
        rel = f.relative_to(root).parts
        if any(p in SKIP_DIRS or p.startswith(("test", "config-")) for p in rel[:-1]) or rel[-1].startswith("test"):
            continue
        out.append(f)
    return out


VERBS = {
    "return",
    "get",
    "set",
    "create",
    "convert",
    "compute",
    "calculate",
    "check",
    "find",
    "remove",
    "add",
    "read",
    "write",
    "parse",
    "build",
    "make",
    "split",
    "join",
    "open",
    "close",
    "send",
    "encode",
    "decode",
    "format",
    "copy",
    "move",
    "update",
    "delete",
    "insert",
    "append",
    "extract",
    "generate",
    "load",
    "save",
    "count",
    "sort",
    "search",
    "replace",
    "validate",
    "test",
    "determine",
    "construct",
    "translate",
    "compare",
    "merge",
    "normalize",
    "escape",
    "unescape",
    "quote",
    "unquote",
    "wrap",
    "fill",
    "strip",
    "truncate",
    "print",
    "apply",
    "register",
    "install",
    "reset",
    "clear",
    "initialize",
    "start",
    "stop",
    "run",
    "call",
    "iterate",
    "yield",
    "produce",
    "list",
    "collect",
    "resolve",
    "expand",
    "compile",
    "match",
    "tokenize",
    "serialize",
    "deserialize",
    "pack",
    "unpack",
    "flatten",
    "filter",
    "map",
    "reduce",
    "round",
    "scale",
    "shift",
    "rotate",
    "reverse",
    "shuffle",
    "select",
    "pick",
    "choose",
    "emit",
    "handle",
    "process",
    "fetch",
    "lookup",
    "look",
    "detect",
    "guess",
    "estimate",
    "measure",
    "display",
    "render",
    "draw",
    "dump",
    "decompress",
    "compress",
    "hash",
    "sign",
    "verify",
    "encrypt",
    "decrypt",
    "raise",
    "wait",
    "sleep",
    "accept",
    "receive",
}


def _summary(doc: str) -> str | None:
    """The docstring's first sentence as an imperative verb phrase ("return the ..."), or None."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    first = first.split(". ")[0].rstrip(".")
    if not 12 <= len(first) <= 160 or ">>>" in first:
        return None
    verb, _, rest = first.partition(" ")
    verb = verb.lower()
    for base in (verb, verb[:-1], verb[:-2]):  # "returns" / "matches" -> the base form
        if base in VERBS and rest:
            return f"{base} {rest}"
    return None


def _third_person(s: str) -> str:
    """'return the x' -> 'returns the x' (the named-function phrasing)."""
    verb, _, rest = s.partition(" ")
    if verb.endswith(("s", "ed")) or not verb.isalpha():
        return s
    verb = verb + ("es" if verb.endswith(("sh", "ch", "x", "o")) else "s")
    return f"{verb} {rest}".strip()


def functions(files: list[Path]):
    """(name, args source, return annotation, docstring) of public documented functions/methods."""
    for f in files:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not 20 <= len(doc) <= 700:
                continue
            args = node.args
            if args.args and args.args[0].arg in ("self", "cls"):
                args = ast.arguments(
                    posonlyargs=args.posonlyargs,
                    args=args.args[1:],
                    vararg=args.vararg,
                    kwonlyargs=args.kwonlyargs,
                    kw_defaults=args.kw_defaults,
                    kwarg=args.kwarg,
                    defaults=args.defaults[-len(args.args[1:]) :] if args.args[1:] and args.defaults else [],
                )
            try:
                sig = ast.unparse(args)
                ret = ast.unparse(node.returns) if node.returns is not None else ""
            except (ValueError, IndexError):
                continue
            yield node.name, sig, ret, doc


def file_excerpts(n: int, rng: random.Random, files: list[Path]) -> list[str]:
    """`n` requests to continue an excerpt of a source file: 12-48 lines from the start of a
    definition (def, class or decorator line), 200-2500 characters, no two alike."""
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8").splitlines())
        except (UnicodeDecodeError, ValueError):
            continue
    starts = [(t, i) for t in texts for i, ln in enumerate(t) if ln.lstrip().startswith(("def ", "class ", "@"))]
    rng.shuffle(starts)
    seen, out = set(), []
    for lines, i in starts:
        excerpt = "\n".join(lines[i : i + rng.randint(12, 48)]).rstrip()
        if not 200 <= len(excerpt) <= 2500 or excerpt in seen:
            continue
        seen.add(excerpt)
        out.append(f"Continue this Python source file.\n```python\n{excerpt}\n```")
        if len(out) >= n:
            break
    return out


def code_prompts(n: int, rng: random.Random, files: list[Path]) -> list[str]:
    seen, out = set(), []
    fns = list(functions(files))
    rng.shuffle(fns)
    for name, sig, ret, doc in fns:
        s = _summary(doc)
        if (name, doc) in seen:
            continue
        seen.add((name, doc))
        kind = rng.random() if s is not None else 0.0  # no verb phrase: the stub, whole docstring
        if kind < 0.4:
            body = "\n".join("    " + ln if ln else "" for ln in doc.splitlines())
            stub = f'def {name}({sig}){" -> " + ret if ret else ""}:\n    """{body.strip()}\n    """\n'
            out.append(f"{rng.choice(STUB_ASKS)}\n```python\n{stub}\n```")
        elif kind < 0.75:
            out.append(rng.choice(SUMMARY_ASKS).format(s=s))
        else:
            out.append(NAMED_ASK.format(name=name, args=sig, s_3rd=_third_person(s)))
        if len(out) >= n:
            break
    return out


def chat_prompts(n: int, rng: random.Random) -> list[str]:
    combos = [(a, t) for a in CHAT_ASKS for t in TOPICS]
    rng.shuffle(combos)
    out = []
    for a, t in combos[:n]:
        u = rng.choice([x for x in TOPICS if x != t])
        out.append(a.format(t=t, u=u))
    return out


def eval_prompts(eval_dir: Path) -> set[str]:
    if not eval_dir.is_dir():
        return set()
    return {
        json.loads(line)["turns"][0]
        for f in eval_dir.glob("*.jsonl")
        for line in f.read_text().splitlines()
        if line.strip()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for code-stdlib.jsonl and chat-topics.jsonl")
    ap.add_argument("--code", type=int, default=4000, help="code prompts (at most; default 4000)")
    ap.add_argument("--chat", type=int, default=3000, help="chat prompts (default 3000)")
    ap.add_argument(
        "--chat-kinds",
        type=int,
        default=0,
        help="prompts of the other chat kinds (bench/chat_prompts.py), in chat-kinds.jsonl (default 0)",
    )
    ap.add_argument(
        "--code-files",
        type=int,
        default=0,
        help="excerpts of source files to continue, in code-files.jsonl (default 0)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--packages",
        nargs="*",
        default=[],
        help="installed packages whose functions make a third file, code-packages.jsonl",
    )
    ap.add_argument("--eval-dir", default=str(Path(__file__).resolve().parents[2] / "shared/data/prompts/eval"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    held = eval_prompts(Path(a.eval_dir))
    files = [
        ("code-stdlib", code_prompts(a.code, random.Random(a.seed), stdlib_files())),
        ("chat-topics", chat_prompts(a.chat, random.Random(a.seed + 1))),
    ]
    if a.packages:
        files.append(("code-packages", code_prompts(a.code, random.Random(a.seed + 2), package_files(a.packages))))
    if a.code_files:
        sources = stdlib_files() + (package_files(a.packages) if a.packages else [])
        files.append(("code-files", file_excerpts(a.code_files, random.Random(a.seed + 4), sources)))
    if a.chat_kinds:
        files.append(("chat-kinds", kind_prompts(a.chat_kinds, random.Random(a.seed + 3), TOPICS)))
    for name, texts in files:
        texts = [t for t in texts if t not in held]
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"turns": [t]}) + "\n")
        print(f"{out / name}.jsonl: {len(texts)} prompts", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
