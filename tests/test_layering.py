"""The package's layers hold: the runtime that runs inside Triton (backend/) does not import the
builder or the client, the kernels import nothing else of the project, and no project modules
import each other in a cycle (imports inside functions count: a lazy import does not remove a
cycle, it only hides it)."""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("backend", "kernels", "builder", "client")
# layer -> layers it must not import
FORBIDDEN = {"backend": {"builder", "client"}, "kernels": {"backend", "builder", "client"}}


def project_modules() -> Dict[str, str]:
    """tritium module name -> source path, for every module of the four layers."""
    mods = {}
    for layer in LAYERS:
        base = os.path.join(ROOT, layer)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                name = f"tritium.{layer}" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))
                mods[name] = os.path.join(dirpath, f)
    return mods


def imported_modules(name: str, path: str, mods: Dict[str, str]) -> Set[str]:
    """Project modules that the module `name` imports anywhere in its source."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)   # `from pkg import submodule`
    resolved = set()
    for m in found:
        while m and m not in mods:
            m = m.rpartition(".")[0]
        if m and m != name:
            resolved.add(m)
    return resolved


def import_graph() -> Dict[str, Set[str]]:
    mods = project_modules()
    return {name: imported_modules(name, path, mods) for name, path in mods.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_covers_the_project():
    graph = import_graph()
    assert "tritium.backend.engine" in graph and "tritium.kernels.ops" in graph
    assert "tritium.backend.triton_backend.model" in graph
    # a known edge, so a resolver that finds nothing cannot pass the checks below
    assert "tritium.backend.scheduler" in graph["tritium.backend.engine"]


def test_layers_import_only_what_they_may():
    bad = [f"{m} imports {t}" for m, targets in import_graph().items() for t in sorted(targets)
           if t.split(".")[1] in FORBIDDEN.get(m.split(".")[1], ())]
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def backend_subpackages(graph: Dict[str, Set[str]]) -> Set[str]:
    """tritium.backend.X for every sub-folder X of backend/ (parallel, speculative, models, ...)."""
    return {".".join(m.split(".")[:3]) for m in graph
            if m.startswith("tritium.backend.") and len(m.split(".")) > 3}


def collapsed(graph: Dict[str, Set[str]], package: str) -> Dict[str, Set[str]]:
    """The graph with every module of `package` merged into one node named `package`."""
    def node(m):
        return package if m == package or m.startswith(package + ".") else m
    out: Dict[str, Set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(node(m), set()).update(node(t) for t in targets if node(t) != node(m))
    return out


def test_no_import_runs_back_up_inside_backend():
    """A sub-folder of backend/ (parallel/, speculative/, models/, triton_backend/) sits either
    above the modules it uses or below those that use it, never both: nothing it imports imports
    it back (config.py importing parallel/layout.py while parallel/runner.py imports the loader,
    which imports config.py, was such a loop)."""
    graph = import_graph()
    bad = []
    for package in sorted(backend_subpackages(graph)):
        for comp in cycles(collapsed(graph, package)):
            if package in comp:
                bad.append(f"{package}: " + " <-> ".join(comp))
    assert not bad, "imports running back up into a backend sub-folder:\n" + "\n".join(bad)


def test_collapsing_finds_a_loop_through_a_package():
    graph = {"p.low": set(), "p.pkg.a": {"p.low"}, "p.mid": {"p.pkg.b"}, "p.pkg.b": set(), "p.top": {"p.pkg.a"}}
    assert cycles(collapsed(graph, "p.pkg")) == []
    graph["p.low"] = {"p.mid"}  # pkg.a -> low -> mid -> pkg.b: back up into the package
    assert cycles(collapsed(graph, "p.pkg")) == [["p.low", "p.mid", "p.pkg"]]


# client/ by job: cli/ (every command) may import everything; nothing imports cli/. serve/ (the
# server process, launch checks, HTTP guard) and openai/ (the OpenAI API) do not import each
# other; the low modules (triton_client.py, security.py, sockets.py) import no folder.
CLIENT_LOW = {"tritium.client.triton_client", "tritium.client.security", "tritium.client.sockets",
              "tritium.client.grpc_setup"}
CLIENT_FOLDERS = ("cli", "serve", "openai", "bench", "tools")
CLIENT_FORBIDDEN = {"serve": {"cli", "openai", "bench", "tools"}, "openai": {"cli", "serve", "bench", "tools"},
                    "bench": {"cli", "tools"}, "tools": {"cli", "bench"}, "low": set(CLIENT_FOLDERS)}


def client_part(module: str):
    """'low', a client folder's name, or None (not in client/, or the package itself)."""
    if module in CLIENT_LOW:
        return "low"
    parts = module.split(".")
    if parts[:2] == ["tritium", "client"] and len(parts) >= 3 and parts[2] in CLIENT_FOLDERS:
        return parts[2]
    return None


def test_client_folders_import_only_what_they_may():
    graph = import_graph()
    for folder in CLIENT_FOLDERS:
        assert any(client_part(m) == folder for m in graph), f"client/{folder}/ is missing"
    loose = [m for m in graph if m.startswith("tritium.client.") and client_part(m) is None
             and m != "tritium.client"]
    assert not loose, f"client modules outside the folders by job: {loose}"
    bad = [f"{m} imports {t}" for m, targets in graph.items() for t in sorted(targets)
           if client_part(t) in CLIENT_FORBIDDEN.get(client_part(m), ())]
    assert not bad, "client layering violations:\n" + "\n".join(bad)
