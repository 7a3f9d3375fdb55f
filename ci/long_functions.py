#!/usr/bin/env python3
"""Functions over 100 lines in src/ must say why, above them.

A function whose body (from its `fn` line to its closing brace) runs past
LIMIT lines fails the check unless one of the comment lines directly above it
(its doc comment, attributes between) holds `Long:` followed by the reason, as
in `// Long: one arm per ioctl, as the kernel's table`. The report lists every
long function with its length, so a count is one command:

    ci/long_functions.py [SRC_DIR]      (default: src next to this script's parent)
"""
import os
import re
import sys

LIMIT = 100
FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:(?:const|async|unsafe|extern\s+\"[^\"]*\")\s+)*fn\s+(\w+)")


def code_only(text):
    """The text with comments, strings and char literals blanked (newlines kept),
    so that braces in them do not count."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = len(re.match(r"r(#*)", text[i:]).group(1))
            end = '"' + "#" * hashes
            j = text.find(end, i + 2 + hashes)
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'", text[i:i + 12])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def long_functions(path):
    """(name, first line, lines, reason or None) of each function over LIMIT."""
    text = open(path, encoding="utf-8").read()
    code = code_only(text)
    lines = text.split("\n")
    code_lines = code.split("\n")
    starts = [0]
    for l in code_lines:
        starts.append(starts[-1] + len(l) + 1)
    found = []
    for no, l in enumerate(code_lines):
        m = FN.match(l)
        if not m:
            continue
        # the body's opening brace: the first `{` after the signature, unless a
        # `;` ends a declaration first (a trait's required method)
        pos = starts[no] + m.end()
        brace = semi = None
        depth_paren = 0
        for k in range(pos, len(code)):
            ch = code[k]
            if ch in "([":
                depth_paren += 1
            elif ch in ")]":
                depth_paren -= 1
            elif ch == ";" and depth_paren == 0:
                semi = k
                break
            elif ch == "{" and depth_paren == 0:
                brace = k
                break
        if brace is None:
            continue
        depth, k = 0, brace
        while k < len(code):
            if code[k] == "{":
                depth += 1
            elif code[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        last = code.count("\n", 0, k)
        length = last - no + 1
        if length <= LIMIT:
            continue
        reason = None
        j = no - 1
        while j >= 0 and re.match(r"^\s*(//|#\[)", lines[j]):
            r = re.search(r"Long:\s*(.+)", lines[j])
            if r and lines[j].lstrip().startswith("//"):
                reason = r.group(1).strip()
            j -= 1
        found.append((m.group(1), no + 1, length, reason))
    return found


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    src = os.path.normpath(src)
    failed, total = False, 0
    for root, _, files in sorted(os.walk(src)):
        for f in sorted(files):
            if not f.endswith(".rs"):
                continue
            p = os.path.join(root, f)
            for name, line, length, reason in long_functions(p):
                total += 1
                rel = os.path.relpath(p, os.path.dirname(src))
                if reason:
                    print(f"long function: {rel}:{line} {name}, {length} lines: {reason}")
                else:
                    failed = True
                    print(f"long function without a reason: {rel}:{line} {name}, {length} lines "
                          f"(split it, or say why above it in a comment line starting 'Long:')")
    print(f"long functions: {total} over {LIMIT} lines")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
