#!/usr/bin/env python3
"""Checks that src/'s includes point down the layers and that no includes form a cycle.

A layer is a top folder of src/ (its subfolders belong to it: transfer/cuda is transfer). A file
may include its own layer and the layers below it (ALLOWED: what CMakeLists.txt links, closed
over). Exits 1 listing each include that points up or sideways and each cycle of files.

  python3 tools/check_layers.py [SRC_DIR]      (ctest: Layers.IncludesPointDown)
"""
import os
import re
import sys

# Each layer and the layers it links directly (CMakeLists.txt's tandem_layer calls).
LINKS = {
    "core": [],
    "backend": ["core"],
    "kv": ["core"],
    "net": ["core"],
    "comm": ["core", "net"],
    "transfer": ["kv", "net"],
    "model": ["backend", "kv", "comm"],
    "engine": ["model", "transfer"],
    "events": ["kv"],
    "disagg": ["engine"],
    "server": ["disagg", "events"],
}


def closure(layer, seen=None):
    seen = set() if seen is None else seen
    for dep in LINKS[layer]:
        if dep not in seen:
            seen.add(dep)
            closure(dep, seen)
    return seen


ALLOWED = {layer: closure(layer) | {layer} for layer in LINKS}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def main():
    src = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "src"))
    problems = []
    graph = {}  # file (relative to src) -> the src files it includes
    for root, _, names in os.walk(src):
        for name in names:
            if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            layer = rel.split(os.sep)[0]
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            graph[rel] = []
            for inc in INCLUDE.findall(text):
                target = inc.split("/")[0]
                if target not in LINKS:
                    continue  # a system or third-party header, or a same-folder one
                graph[rel].append(inc)
                if layer in LINKS and target not in ALLOWED[layer]:
                    problems.append(f"{rel}: includes \"{inc}\" ({layer}/ may include only "
                                    f"{', '.join(sorted(ALLOWED[layer]))})")
    # Cycles of files (an iterative depth-first search).
    state = {}
    for start in sorted(graph):
        if start in state:
            continue
        stack = [(start, iter(graph[start]))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
                continue
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                problems.append("include cycle: " + " -> ".join(cycle))
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(graph[nxt])))
                path.append(nxt)
    for p in problems:
        print(p)
    print(f"{len(graph)} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
