"""k3train's modules import each other without a cycle.

Every import statement is read from the source (module level or inside functions, `import x` and `from x import y`,
relative ones resolved), so a cycle hidden in a function body is found too. Importing `a.b.c` runs the package
`a.b` first, so it counts as an edge to every enclosing package of k3train as well."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "k3train"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}

    def add(src: str, target: str) -> None:
        # `from pkg import name` may name a submodule: prefer it when it exists.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # the target and every enclosing package run on import
            dep = ".".join(parts[:i])
            if dep in modules and dep != src and not src.startswith(dep + "."):
                graph[src].add(dep)

    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("k3train"):
                        add(name, a.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod.startswith("k3train"):
                    for a in node.names:
                        add(name, f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_k3train():
    assert find_cycles(import_graph()) == []


def test_the_checker_sees_cycles():
    # A module-level cycle, one inside a function, and one through a package's __init__ are all found.
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    g = import_graph()
    assert "k3train.parallel.mesh" in g["k3train.parallel.engine"]  # module level
    assert "k3train.parallel.parallelize" in g["k3train.parallel.engine"]  # inside build_engine
    assert "k3train.parallel" in g["k3train.train.trainer"]  # the package runs first


LAYERS = (
    ("errors", "digest", "distributed"),  # what every layer raises, hashes and communicates with
    ("ops",),  # tensor ops and their context parallelism (k3kernels beside them)
    ("models",),  # modules, their matrix structure, costs and activation rules
    ("optim", "data", "activation"),  # optimizers and their sharding plan; data; activation storage
    ("parallel",),  # mesh, pipeline, ZeRO buckets, EP, CP layout, the engine
    ("config",),  # the schema and its resolution into a RunSpec
    ("plan",),  # the planner, composing the models' costs over a RunSpec
    ("converge", "dryrun"),  # one recipe under several layouts; one rank's full-size step on fake tensors
    ("train",),
    ("export",),  # a run's checkpoint written in the released precision
)
"""k3train's packages from the bottom up: a package imports only packages of its own row or below, module-level
and lazy imports alike (a package of the same row: none do today)."""


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    rank = {pkg: i for i, row in enumerate(LAYERS) for pkg in row}
    out = []
    for src, deps in graph.items():
        for dep in deps:
            a, b = package_of(src), package_of(dep)
            if a in rank and b in rank and rank[b] > rank[a]:
                out.append((src, dep))
    return sorted(out)


def test_packages_import_downward():
    graph = import_graph()
    every = {package_of(m) for m in graph} - {""}
    assert every == {pkg for row in LAYERS for pkg in row}, "a package is missing from LAYERS"
    assert upward_imports(graph) == []
    assert upward_imports({"k3train.optim.x": {"k3train.parallel.y"}}) == [("k3train.optim.x", "k3train.parallel.y")]
    # Same-row packages do not import each other either: their order within the row is free.
    rows = {pkg: i for i, row in enumerate(LAYERS) for pkg in row}
    sideways = sorted(
        (src, dep)
        for src, deps in graph.items()
        for dep in deps
        if package_of(src) != package_of(dep)
        and package_of(src) in rows
        and rows.get(package_of(dep)) == rows[package_of(src)]
        and len(LAYERS[rows[package_of(src)]]) > 1
        and package_of(src) not in ("errors", "digest", "distributed")
    )
    assert sideways == [], sideways


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages a wheel carries; a subpackage missing there imports from a checkout but not
    from an installed wheel."""
    import tomllib

    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {module_name(p) for p in PKG.rglob("__init__.py")}
    assert present <= listed, sorted(present - listed)
    # Hydra's plugins (a namespace package without an __init__.py of its own)
    plugins = {f"hydra_plugins.{p.parent.name}" for p in (PKG.parent / "hydra_plugins").glob("*/__init__.py")}
    assert plugins and plugins <= listed, sorted(plugins - listed)
