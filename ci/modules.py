#!/usr/bin/env python3
"""Check dmkit's module structure; exit 1 with the offending lines if it is broken.

Three rules (issues 31 and 51):
1. No import cycles among the modules directly inside any directory of `src/`
   (the crate's top level, and every directory under it). A module "imports"
   another when any of its files names a path into it (`crate::x::...`,
   `super::...` resolved, `use` or inline; a name a `pub use` re-exports counts
   as the module it comes from, so `crate::mapper::Registry` names
   `mapper::registry`). One known cycle is allowed
   (KNOWN_CYCLES, with its reason) until it is split.
2. The top-level modules are in layers (LAYERS, lowest first): a module names
   only modules of lower layers, never one beside it or above it.
3. The core names no concrete target: outside `src/targets/`, no path names a
   target module (`targets::linear`, `targets::thin::pool`, ...). The registry
   learns the target types from the list `targets` hands it.

Usage: ci/modules.py [SRC_DIR]   (default: src next to this script's parent)
"""
import os
import re
import sys

# The top-level modules, lowest layer first. A module may name modules of
# lower layers only; two modules of one layer stand beside each other.
LAYERS = [
    # leaves: no other module of the crate (client: the control protocol's
    # framing and the run directory, which io's hold diagnostics ask with)
    ["rng", "layout"],
    # sync's trial scheduler draws its choices from rng
    ["sync", "panics", "gf256", "extents", "table", "client"],
    ["lograte", "io"],
    # the copy engine and persistent data, over io
    ["copier", "pdata"],
    # the metadata formats and their tools, each on persistent data alone
    ["thin", "era", "cache"],
    ["mapper"],
    ["targets"],
    # frontends and the simulator, over the targets
    ["export", "lvmd", "sim"],
    ["control"],
    ["daemon"],
]

# Cycles known and allowed, by directory, with why: the target interface file
# holds the map context the engine drives (MapCtx, Join, Owned), and the
# context makes the engine's pieces.
KNOWN_CYCLES = {("mapper", ("engine", "target"))}
PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
# `use crate::{a, b::c}` names several modules at once
USE_GROUP = re.compile(r"\buse\s+(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\}\s*;", re.S)


def module_of(rel):
    """src-relative file path -> module path as a list (lib.rs -> [])."""
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return parts


def strip_comments_and_strings(text):
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif text.startswith("r#\"", i):
            j = text.find('"#', i + 3)
            j = n if j < 0 else j + 2
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c == "'" and i + 2 < n and (text[i + 2] == "'" or (text[i + 1] == "\\" and "'" in text[i + 2:i + 6])):
            j = text.find("'", i + 2 if text[i + 1] != "\\" else i + 3)
            out.append("' '")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


PUB_USE = re.compile(r"\bpub(?:\([a-z]+\))?\s+use\s+([^;]+);")


def use_tree(tree):
    """`a::{b, c::{d as e}}` -> [(["a", "b"], "b"), (["a", "c", "d"], "e")]."""
    tree = re.sub(r"\s+", " ", tree).strip()
    brace = tree.find("{")
    if brace < 0:
        path, _, alias = tree.partition(" as ")
        names = [p for p in path.strip().split("::") if p]
        return [(names, alias.strip() or names[-1])] if names else []
    head = [p for p in tree[:brace].split("::") if p]
    body, depth, item, items = tree[brace + 1:tree.rfind("}")], 0, "", []
    for c in body:
        depth += (c == "{") - (c == "}")
        if c == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += c
    items.append(item)
    out = []
    for it in items:
        for names, alias in use_tree(it):
            if names == ["self"]:
                out.append((head, head[-1]))
            else:
                out.append((head + names, alias))
    return out


def absolute(mod, names):
    """A path written in module `mod` that starts with `crate`, `super` or `self`,
    as an absolute path (`super` from a file `a/b.rs`, module a::b, is `a`;
    chains of super go up)."""
    if names[0] == "crate":
        return names[1:]
    base = list(mod)
    while names and names[0] == "super":
        names, base = names[1:], base[:-1]
    return base + [n for n in names if n != "self"]


def reexports(files, modules):
    """{(module, name): the path it names} for every `pub use` of the crate, so
    that `crate::mapper::Registry` counts as naming `mapper::registry`."""
    out = {}
    for rel, text in files.items():
        mod = module_of(rel)
        for m in PUB_USE.finditer(strip_comments_and_strings(text)):
            for names, alias in use_tree(m.group(1)):
                if names[0] in ("crate", "super", "self"):
                    path = absolute(mod, names)
                elif tuple(mod + names[:1]) in modules:
                    path = mod + names
                else:
                    continue  # another crate's item
                out[(tuple(mod), alias)] = path
    return out


def through_reexports(ref, modules, exported):
    """The module path a crate path really names, re-exports followed."""
    for _ in range(8):
        for i in range(len(ref)):
            if tuple(ref[: i + 1]) in modules:
                continue
            target = exported.get((tuple(ref[:i]), ref[i]))
            if target is None:
                return ref
            ref = target + ref[i + 1:]
            break
        else:
            return ref
    return ref


def references(mod, text, modules, exported):
    """(line, absolute module path) for every crate path the text names."""
    text = strip_comments_and_strings(text)
    refs = []

    def resolve(root, tail, is_file_mod):
        return absolute(mod, [root] + [p for p in tail.split("::") if p])

    for m in USE_GROUP.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        for item in re.split(r"[,{}\s]+", m.group(3)):
            item = item.strip()
            if not item or item in ("self", "*"):
                continue
            refs.append((line, resolve(m.group(1), m.group(2) + "::" + item, False)))
    for m in PATH.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        refs.append((line, resolve(m.group(1), m.group(2), False)))
    return [(line, through_reexports(ref, modules, exported)) for line, ref in refs]


def sccs(nodes, edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return [c for c in out if len(c) > 1]


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    files = {}
    for root, _, names in os.walk(src):
        for n in names:
            if n.endswith(".rs"):
                rel = os.path.relpath(os.path.join(root, n), src)
                if rel.startswith("bin" + os.sep):
                    continue
                with open(os.path.join(root, n), encoding="utf-8") as f:
                    files[rel] = f.read()
    targets = sorted(
        {module_of(r)[1] for r in files if r.startswith("targets" + os.sep) and len(module_of(r)) > 1}
    )
    modules = {tuple(module_of(rel)) for rel in files}
    exported = reexports(files, modules)
    failed = False
    scopes = sorted({tuple(module_of(rel)[:-1]) if not rel.endswith(("mod.rs", "lib.rs")) else tuple(module_of(rel)) for rel in files})
    scopes = sorted({s[:i] for s in scopes for i in range(len(s) + 1)})
    top_edges = {}
    for scope in scopes:
        depth = len(scope)
        edges, why, nodes = {}, {}, set()
        for rel, text in files.items():
            mod = module_of(rel)
            if tuple(mod[:depth]) != scope or len(mod) <= depth:
                continue
            a = mod[depth]
            nodes.add(a)
            for line, ref in references(mod, text, modules, exported):
                if tuple(ref[:depth]) != scope or len(ref) <= depth:
                    continue
                b = ref[depth]
                if b == a:
                    continue
                edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), []).append(f"src/{rel}:{line}")
        if not scope:
            top_edges = (edges, why)
        name = "/".join(scope)
        for comp in sccs(nodes | {b for s in edges.values() for b in s}, edges):
            if (name, tuple(comp)) in KNOWN_CYCLES:
                continue
            failed = True
            where = f"inside src/{name}/" if scope else "among the top-level modules"
            print(f"import cycle {where}: {' <-> '.join(comp)}")
            for a in comp:
                for b in sorted(edges.get(a, ())):
                    if b in comp:
                        first = why[(a, b)]
                        more = f" (+{len(first) - 1} more)" if len(first) > 1 else ""
                        print(f"  {a} -> {b}: {first[0]}{more}")
    layer = {m: i for i, ms in enumerate(LAYERS) for m in ms}
    edges, why = top_edges
    for a in sorted(edges):
        for b in sorted(edges[a]):
            if a not in layer or b not in layer:
                failed = True
                print(f"top-level module {a if a not in layer else b} is in no layer (ci/modules.py LAYERS): {why[(a, b)][0]}")
            elif layer[b] >= layer[a]:
                failed = True
                side = "beside" if layer[b] == layer[a] else "above"
                print(f"{a} names {b}, a module {side} it in the layers: {why[(a, b)][0]} (+{len(why[(a, b)]) - 1} more)")
    for m in sorted({module_of(r)[0] for r in files if module_of(r)}):
        if m not in layer:
            failed = True
            print(f"top-level module {m} is in no layer (ci/modules.py LAYERS)")
    for rel, text in sorted(files.items()):
        mod = module_of(rel)
        if mod and mod[0] == "targets":
            continue
        for line, ref in references(mod, text, modules, exported):
            if len(ref) >= 2 and ref[0] == "targets" and ref[1] in targets:
                failed = True
                print(f"src/{rel}:{line}: names the concrete target module targets::{ref[1]} outside src/targets/")
    if failed:
        sys.exit(1)
    print(
        f"modules: no import cycles in {len(scopes)} directories ({len(files)} files; "
        f"{len(KNOWN_CYCLES)} known), the top level in {len(LAYERS)} layers, "
        "no concrete target named outside src/targets/"
    )


if __name__ == "__main__":
    main()
