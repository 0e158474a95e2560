"""Code-completion prompts (the LCC setting of the AASD paper) from the standard library's own source,
modules n-r only (the draft was distilled on modules a-m), and their scores.

    python bench/code_prompts.py [--n 16] [--show 3]     # print the set's sizes and a few prompts

A candidate is a function or method with a docstring, every line after its `def` indented further,
and at least 10 lines of body after the docstring. Prompt: its source from the `def` line (dedented to
column 0) through the docstring and the body up to its 2nd non-blank line, ending with a newline.
Reference: the next 8 lines of the real function. Selection is deterministic: modules sorted by name,
each module's candidates by line, taken round robin (the 1st of every module, then the 2nd, ...; a
level only partly needed takes evenly spaced modules), listed by module then line.
"""

from __future__ import annotations

import argparse
import ast
import os
import sysconfig

FIRST_LETTERS = "nopqr"
PROMPT_BODY_LINES = 2  # non-blank body lines after the docstring kept in the prompt
REFERENCE_LINES = 8
MIN_BODY_LINES = 10
MAX_PROMPT_CHARS = 2000


def stdlib_files() -> list[tuple[str, str]]:
    """(module name, path) of the top-level .py files and top-level packages' own .py files, n-r."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for entry in sorted(os.listdir(root)):
        if entry[0] not in FIRST_LETTERS:
            continue
        path = os.path.join(root, entry)
        if entry.endswith(".py") and os.path.isfile(path):
            found.append((entry[:-3], path))
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            found += [(f"{entry}.{f[:-3]}".removesuffix(".__init__"), os.path.join(path, f))
                      for f in sorted(os.listdir(path)) if f.endswith(".py")]
    return sorted(found)


def _candidates(module: str, source: str) -> list[dict]:
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        col = node.col_offset
        func = lines[node.lineno - 1: node.end_lineno]  # `def` line (decorators excluded) to the end
        if any(ln.strip() and len(ln) - len(ln.lstrip()) <= col for ln in func[1:]):
            continue  # a line not right of the def (inside a string): it would read as the function's end
        func = [ln[col:].rstrip() for ln in func]
        body = func[node.body[0].end_lineno - node.lineno + 1:]  # after the docstring's last line
        nonblank = [i for i, ln in enumerate(body) if ln.strip()]
        if len(body) < MIN_BODY_LINES or len(nonblank) <= PROMPT_BODY_LINES:
            continue
        cut = nonblank[PROMPT_BODY_LINES - 1] + 1
        reference = body[cut: cut + REFERENCE_LINES]
        prompt = "\n".join(func[: len(func) - len(body) + cut]) + "\n"
        if len(reference) < REFERENCE_LINES or len(prompt) > MAX_PROMPT_CHARS or not "".join(reference).strip():
            continue
        out.append({"prompt": prompt, "reference": "\n".join(reference).rstrip() + "\n", "module": module,
                    "name": node.name, "line": node.lineno})
    return sorted(out, key=lambda c: c["line"])


def code_prompts(n: int) -> list[dict]:
    """`n` prompts (dicts: prompt, reference, module, name, line), round robin over the modules n-r."""
    per_module = []
    for module, path in stdlib_files():
        with open(path, encoding="utf-8") as f:
            cands = _candidates(module, f.read())
        if cands:
            per_module.append(cands)
    picked, depth = [], 0
    while len(picked) < n and any(depth < len(c) for c in per_module):
        level = [c[depth] for c in per_module if depth < len(c)]
        want = min(n - len(picked), len(level))  # a partial last level: evenly spaced over the modules
        picked += [level[i * len(level) // want] for i in range(want)]
        depth += 1
    return sorted(picked, key=lambda c: (c["module"], c["line"]))


def levenshtein(a: str, b: str) -> int:
    """Character edit distance, two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _trim(text: str, n_lines: int | None = None) -> str:
    lines = [ln.rstrip() for ln in text.splitlines()]
    return "\n".join(lines[:n_lines]).rstrip()


def edit_similarity(completion: str, reference: str) -> float:
    """1 - Levenshtein / max length (LCC), on the completion cut to the reference's line count, both with
    trailing whitespace stripped (per line and at the end)."""
    ref = _trim(reference)
    hyp = _trim(completion, len(ref.splitlines()))
    if not ref and not hyp:
        return 1.0
    return 1.0 - levenshtein(hyp, ref) / max(len(hyp), len(ref))


def parses(prompt: str, completion: str) -> bool:
    """Whether the function still parses. Rule: split prompt + completion into lines; the function ends
    before the first line after the `def` line that starts at column 0 and is neither blank nor a comment
    (it and all after it are dropped). `ast.parse` what is left; True if it parses. Only when no such
    end was found (the completion was cut by max_new_tokens mid-function) is it also tried with its last
    1, 2 or 3 lines removed (never lines of the prompt), True if any of those parses."""
    lines = (prompt + completion).splitlines()
    n_prompt = len(prompt.splitlines())
    end = next((i for i in range(1, len(lines))
                if lines[i].strip() and not lines[i][0].isspace() and not lines[i].startswith("#")), None)
    lines = lines if end is None else lines[:end]
    drops = 0 if end is not None else min(3, len(lines) - n_prompt)
    for drop in range(max(drops, 0) + 1):
        try:
            ast.parse("\n".join(lines[: len(lines) - drop]) + "\n")
            return True
        except (SyntaxError, ValueError):
            continue
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--show", type=int, default=3, help="prompts and references to print")
    args = ap.parse_args()
    ps = code_prompts(args.n)
    print(f"# {len(ps)} prompts from {len({p['module'] for p in ps})} modules: "
          + ", ".join(f"{p['module']}.{p['name']}" for p in ps))
    ok = sum(parses(p["prompt"], p["reference"]) for p in ps)
    print(f"# the reference itself: parses {ok}/{len(ps)}, edit similarity to itself "
          f"{min(edit_similarity(p['reference'], p['reference']) for p in ps):.2f}")
    for p in ps[: args.show]:
        print(f"\n=== {p['module']}.{p['name']} (line {p['line']}) prompt:\n{p['prompt']}--- reference:\n"
              f"{p['reference']}", end="")


if __name__ == "__main__":
    main()
