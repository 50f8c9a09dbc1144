"""The house plan, checked: which part of durable_memory/ may import which (docs/architecture.md).

The rules are data, at the top, so that a reader sees them in one place. The checks read the
source with `ast` (nothing is imported), and count every import, the ones inside functions and
under TYPE_CHECKING too: a lazy or type-only import that points upward still couples the parts.
"""

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "durable_memory"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

LAYERS: tuple[tuple[str, ...], ...] = (
    # Bottom first. A module may import its own part and any part of a lower layer; parts that
    # share a layer are independent of each other. A module's part is the longest prefix of its
    # dotted name (below durable_memory.) listed here.
    ("models", "faults", "profiles", "scripts", "loopback_server"),  # plain data; crash
    # points; bundled files; the background HTTP server of our own local servers
    ("memory",),  # the domain: synchronous, no Temporal (see DOMAIN below)
    # settings (ConfigError is a domain error); the offline model; `dmem git-serve`
    ("config", "scripted_model", "gitserver"),
    ("bootstrap",),  # the composition root: the memory stack built from settings
    ("codec",),  # per-user payload encryption: the Temporal codec, its keys, `dmem codec-server`
    ("activities",),  # thin @activity.defn adapters over the stack bootstrap built
    ("workflows",),  # deterministic orchestration, calling activities
    ("decision_delivery",),  # the client's decision Update to a turn, and its refusals read
    ("workers", "client"),  # run workflows and activities | start and talk to workflows
    ("review",),  # `dmem serve`: the review page, a thin client over MemoryClient
    ("workers.main",),  # the bodies of `dmem worker` and `dmem dev`: a worker plus the client
    ("demo",),  # `dmem demo`: a dev server, a worker, the client and a scripted model
    ("cli",),  # the commands
)

DOMAIN: dict[str, tuple[str, ...]] = {
    # Inside memory/: the parts each part may import (besides the lower layers above).
    "memory": (),
    "memory.core": ("memory.core",),  # blocks, formats, profiles, personas, ids, errors, tokens
    "memory.store": ("memory.core", "memory.store"),  # git repository, SQL tables, diffs, recall
    "memory.archive": ("memory.core", "memory.store", "memory.archive"),  # archival memory
    # the faces: blocks, edits, review, history
    "memory.service": ("memory.core", "memory.store", "memory.service"),
    # context compiler, tools, the turn steps
    "memory.agent": (
        "memory.core",
        "memory.store",
        "memory.archive",
        "memory.service",
        "memory.agent",
    ),
    # strategies, planner
    "memory.rotation": (
        "memory.core",
        "memory.store",
        "memory.archive",
        "memory.service",
        "memory.rotation",
    ),
}

TEMPORAL_PARTS = (
    "codec",
    "activities",
    "workflows",
    "decision_delivery",
    "workers",
    "client",
    "workers.main",
    "cli",
    "demo",
)
"""The only parts that may import temporalio: the domain, its models and bootstrap never do."""

ONLY_THROUGH: dict[tuple[str, str], tuple[str, ...]] = {
    # (importer's part, package): the only modules of that package the importer may use.
    # The CLI starts a worker only by running `dmem worker` / `dmem dev`; the client, never.
    ("cli", "workers"): ("workers.main",),
    # The review page is a thin client: it runs beside workers, never with their code.
    ("review", "workers"): (),
}

STACK_ASSEMBLERS = ("bootstrap", "workers")
"""The only parts that build the memory stack's parts; the others ask bootstrap for a stack."""
STACK_PARTS = (
    "MemoryStack",
    "MemoryFaces",
    "BlockAccess",
    "GitBlockStore",
    "DiffStore",
    "RecallStore",
    "SummaryStore",
    "TurnStore",
    "RotationStateStore",
    "SqliteArchive",
    "WeaviateArchive",
    "Rotator",
    "MemoryTools",
    "make_engine",
)

MAX_MODULES_PER_FOLDER = 12
LONG_MODULE_LINES = 300
"""A module longer than this says at its top (its docstring) what it holds and why it is one."""


@dataclass(frozen=True)
class Module:
    name: str
    """Dotted, below durable_memory. ("memory.core.ids"); "" for the package itself."""
    path: Path
    tree: ast.Module


@dataclass(frozen=True)
class Import:
    module: Module
    target: str
    """Dotted, below durable_memory. if `ours`, else the full name (temporalio.client)."""
    ours: bool
    line: int

    def where(self) -> str:
        target = f"{PACKAGE}.{self.target}".rstrip(".") if self.ours else self.target
        return f"{self.module.path.relative_to(ROOT.parent)}:{self.line} imports {target}"


def _modules() -> list[Module]:
    modules = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        modules.append(Module(".".join(parts), path, tree))
    return modules


MODULES = _modules()
MODULE_NAMES = {m.name for m in MODULES}


def _ours(dotted: str) -> str | None:
    if dotted == PACKAGE:
        return ""
    return dotted.removeprefix(PACKAGE + ".") if dotted.startswith(PACKAGE + ".") else None


def _imports(module: Module) -> Iterator[Import]:
    """Every import in the module, relative ones resolved."""
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                ours = _ours(alias.name)
                yield Import(module, ours or alias.name, ours is not None, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                ours = ".".join([*base, *([node.module] if node.module else [])])
            else:
                ours = _ours(node.module or "")
            if ours is None:
                yield Import(module, node.module or "", False, node.lineno)
                continue
            for alias in node.names:  # `from pkg import module` imports that module
                child = f"{ours}.{alias.name}".lstrip(".")
                yield Import(module, child if child in MODULE_NAMES else ours, True, node.lineno)


def _part(name: str, parts: Iterable[str]) -> str | None:
    """The longest of `parts` that is `name` or a dotted prefix of it."""
    matches = [p for p in parts if name == p or name.startswith(p + ".")]
    return max(matches, key=len) if matches else None


ALL_PARTS = tuple(part for layer in LAYERS for part in layer)
LAYER_OF = {part: index for index, layer in enumerate(LAYERS) for part in layer}
IMPORTS = list(dict.fromkeys(i for m in MODULES if m.name for i in _imports(m)))
"""Once per (module, imported module, line): `from x import a, b` is one import of x."""


def _report(violations: list[str]) -> None:
    assert not violations, f"{len(violations)} import(s) break the house plan:\n" + "\n".join(
        violations
    )


def test_every_module_has_a_place_in_the_plan() -> None:
    homeless = [str(m.path) for m in MODULES if m.name and _part(m.name, ALL_PARTS) is None]
    assert not homeless, f"add these modules' part to LAYERS in {__file__}: {homeless}"
    in_memory = [m.name for m in MODULES if m.name.startswith("memory")]
    assert all(_part(name, DOMAIN) for name in in_memory), "every memory/ part is in DOMAIN"


def test_imports_point_down_the_layers() -> None:
    violations = []
    for imp in IMPORTS:
        if not imp.ours or not imp.target:
            continue
        mine, theirs = _part(imp.module.name, ALL_PARTS), _part(imp.target, ALL_PARTS)
        assert mine is not None, imp.where()
        assert theirs is not None, imp.where()
        if mine == theirs or LAYER_OF[theirs] < LAYER_OF[mine]:
            continue
        direction = "a part of the same layer" if LAYER_OF[theirs] == LAYER_OF[mine] else "above"
        violations.append(
            f"{imp.where()}: rule: {mine} may import only lower layers, and {theirs} is {direction}"
        )
    _report(violations)


def test_the_domain_parts_import_only_their_own_and_lower_parts() -> None:
    violations = []
    for imp in IMPORTS:
        if not (
            imp.ours and imp.module.name.startswith("memory") and imp.target.startswith("memory")
        ):
            continue
        mine, theirs = _part(imp.module.name, DOMAIN), _part(imp.target, DOMAIN)
        assert mine is not None, imp.where()
        assert theirs is not None, imp.where()
        if theirs not in DOMAIN[mine]:
            violations.append(f"{imp.where()}: rule: {mine} may import only {DOMAIN[mine]}")
    _report(violations)


def test_only_the_temporal_parts_import_temporalio() -> None:
    violations = [
        f"{imp.where()}: rule: only {TEMPORAL_PARTS} may import temporalio"
        for imp in IMPORTS
        if not imp.ours
        and imp.target.split(".")[0] == "temporalio"
        and _part(imp.module.name, ALL_PARTS) not in TEMPORAL_PARTS
    ]
    _report(violations)


def test_narrow_entries_are_the_only_way_in() -> None:
    violations = []
    for imp in IMPORTS:
        for (importer, package), allowed in ONLY_THROUGH.items():
            if (
                imp.ours
                and _part(imp.module.name, ALL_PARTS) == importer
                and (imp.target == package or imp.target.startswith(package + "."))
                and imp.target not in allowed
            ):
                violations.append(
                    f"{imp.where()}: rule: {importer} uses {package}/ only through {allowed}"
                )
    _report(violations)


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def test_only_bootstrap_and_the_workers_assemble_the_stack() -> None:
    defined = {
        node.name
        for m in MODULES
        for node in ast.walk(m.tree)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef))
    }
    stale = sorted(set(STACK_PARTS) - defined)
    assert not stale, f"STACK_PARTS names {stale}, which no module defines: update the list"
    violations = [
        f"{m.path.relative_to(ROOT.parent)}:{node.lineno} calls {_called_name(node)}(): "
        f"rule: only {STACK_ASSEMBLERS} build the stack; use bootstrap.open_stack "
        "or bootstrap.stack_from_settings"
        for m in MODULES
        if m.name and _part(m.name, ALL_PARTS) not in STACK_ASSEMBLERS
        for node in ast.walk(m.tree)
        if isinstance(node, ast.Call) and _called_name(node) in STACK_PARTS
    ]
    _report(violations)


def test_folders_stay_small_and_long_modules_say_why() -> None:
    problems = []
    for folder in sorted({m.path.parent for m in MODULES}):
        count = sum(1 for m in MODULES if m.path.parent == folder and m.path.name != "__init__.py")
        if count > MAX_MODULES_PER_FOLDER:
            problems.append(
                f"{folder.relative_to(ROOT.parent)}/ holds {count} modules: "
                f"rule: at most {MAX_MODULES_PER_FOLDER}; split it into parts that say what they hold"
            )
    for m in MODULES:
        lines = len(m.path.read_text(encoding="utf-8").splitlines())
        if lines > LONG_MODULE_LINES and not ast.get_docstring(m.tree):
            problems.append(
                f"{m.path.relative_to(ROOT.parent)} has {lines} lines and no docstring: rule: a "
                f"module over {LONG_MODULE_LINES} lines says at its top why it is one module"
            )
    assert not problems, "\n".join(problems)
