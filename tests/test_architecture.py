"""The package's shape, checked from its source: dependencies point one way (core/, stop/,
config/ <- checkpoint/, slurm/, rescue/, integrations/, supervise/ <- runstate/ <- shutdown/ <-
run/ <- trainers/ <- cli/, demo/), a folder is a layer or one job within one, the shutdown
steps never reach forward, no module sets an attribute on another module's part (only records are filled in from
outside), nothing guesses its caller from ``sys.modules``, and docs/design.md's picture names
every module.

Imports are read with ``ast`` (every import in a module, at the top or inside a function), so a
lazy import counts as much as a top-level one, and so does one under ``if TYPE_CHECKING:``: a
cycle of type imports is still two modules that cannot be read one without the other.
"""

from __future__ import annotations

import ast
import functools
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kempner_resilience"

# Every module's layer, by its folder (the first part of its path; "" is the package's own
# __init__.py; "exitcodes", the exit codes, is a core module at the root because its path is
# public). docs/design.md argues it.
LAYERS = {
    "core": {"core", "config", "stop", "exitcodes"},
    "library": {"checkpoint", "slurm", "rescue", "integrations", "supervise"},
    "run": {"", "run", "shutdown", "runstate", "trainers"},
    "top": {"cli", "demo", "checkresume", "ray"},
}
# The package root holds only the public names and the public exit-code path: every other
# module is in the folder of its layer or job.
ROOT_MODULES = {"", "exitcodes"}
ABOVE = {  # what each layer must never import
    "core": LAYERS["library"] | LAYERS["run"] | LAYERS["top"],
    "library": LAYERS["run"] | LAYERS["top"],
    "run": LAYERS["top"],
}

# Within the run layer, the folders in order: each imports only from itself and the folders
# before it. The run's state is shared by its set-up, loop and shutdown; the shutdown sequence
# takes that state and never the run (``run`` -> ``shutdown`` only, no cycle between them).
RUN_LAYER_ORDER = ["runstate", "shutdown", "run", "trainers", ""]

# The shutdown path in order; each step's module imports nothing of the steps after it.
SHUTDOWN_STEPS = ["stop.signals", "stop.agreement", "checkpoint.manager", "slurm.requeue",
                  "stop.teardown", "shutdown.exit"]

# (module, the name it looks up in sys.modules) -> why that is not sniffing the caller.
SYS_MODULES_ALLOWED = {
    ("core.faults", "torch.distributed"): "a collective error can only come from torch.distributed if "
                                     "it is loaded; looking it up avoids importing torch",
    ("stop.agreement", "torch.distributed"): "no process group exists unless torch.distributed is "
                                        "loaded; from_torch must not import torch to find out",
    ("stop.teardown", "torch"): "no CUDA work to synchronize unless torch is loaded; teardown must "
                           "not import torch (seconds) while the deadline runs",
    ("stop.teardown", "torch.distributed"): "no process group to destroy unless torch.distributed "
                                       "is loaded",
    ("supervise.submitit.jobs", "torch"): "no tensor can be in a submission unless torch is "
                                        "loaded; the check must not import torch",
    ("supervise.local.warm", "."): "the zygote's own check that it never loaded the package, "
                                "where a step runs (what it loaded is the point)",
    ("supervise.local.warm", "torch.distributed"): "the zygote's own check that it holds no "
                                                "process group; a zygote may preload no torch",
    ("supervise.local.warm", "torch.cuda"): "the zygote's own check that no import initialised "
                                         "CUDA; a zygote may preload no torch",
}
# The run.py rewrite (issue 12, shutdown/) removes run.py's "pytest"/"ipykernel" checks; until
# it is merged into this branch, they are the only sniffing tolerated.
PENDING_SNIFFERS = set() if (PKG / "shutdown").is_dir() else {"run"}


def _modules() -> dict[str, Path]:
    """'checkpoint.manager' -> its file; the package's __init__ is ''."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package modules ``name`` imports ('' for ``kempner_resilience`` itself)."""
    path = MODULES[name]
    parts = name.split(".") if name else []
    package = parts if path.name == "__init__.py" else parts[:-1]
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(["kempner_resilience", *base, *filter(None, [node.module])])
            else:
                module = node.module or ""
            # `from pkg import sub` imports the submodule; `from pkg import name` the package.
            targets = [f"{module}.{a.name}" if _local(f"{module}.{a.name}") in MODULES else module
                       for a in node.names]
        else:
            continue
        found |= {_local(t) for t in targets
                  if t == "kempner_resilience" or t.startswith("kempner_resilience.")}
    found.discard(name)
    return found


def _local(dotted: str) -> str:
    return dotted.removeprefix("kempner_resilience").removeprefix(".")


IMPORTS = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> str | None:
    head = name.split(".")[0]
    return next((layer for layer, heads in LAYERS.items() if head in heads), None)


def _violations(layer: str) -> list[str]:
    return [f"{name or '__init__'} ({layer}) imports {dep or 'kempner_resilience'}"
            for name in MODULES if _layer(name) == layer
            for dep in sorted(IMPORTS[name]) if dep.split(".")[0] in ABOVE[layer]]


def test_every_module_belongs_to_a_layer():
    known = set().union(*LAYERS.values())
    assert [n for n in MODULES if n.split(".")[0] not in known] == [], \
        "add the new module's package to LAYERS (and to docs/design.md)"


def test_core_modules_import_nothing_from_the_layers_above():
    assert _violations("core") == []


def test_checkpoint_and_slurm_import_nothing_from_the_run_or_above():
    assert _violations("library") == []


def test_run_and_shutdown_import_nothing_from_the_cli_or_demo():
    assert _violations("run") == []


def _backward_imports(folder: str) -> list[str]:
    """Imports from ``folder`` into the folders after it in ``RUN_LAYER_ORDER``."""
    later = set(RUN_LAYER_ORDER[RUN_LAYER_ORDER.index(folder) + 1:])
    return [f"{name or '__init__'} imports {dep or 'kempner_resilience'}"
            for name in MODULES if (name.split(".")[0] if name else "") == folder
            for dep in sorted(IMPORTS[name]) if (dep.split(".")[0] if dep else "") in later]


def test_the_run_layer_folders_are_all_in_its_order():
    assert sorted(LAYERS["run"]) == sorted(RUN_LAYER_ORDER)


def test_shutdown_never_imports_the_run():
    # The shutdown sequence works on the run's state (runstate/), never on ResilientRun or its
    # set-up: the run calls the shutdown, not the other way round.
    assert _backward_imports("shutdown") == []


def test_the_run_state_imports_neither_the_shutdown_nor_the_run():
    assert _backward_imports("runstate") == []


def test_no_module_sits_loose_at_the_package_root():
    assert sorted(n for n in MODULES if "." not in n and not (PKG / n).is_dir()
                  and n not in ROOT_MODULES) == [], \
        "put it in the folder of its layer or job (docs/design.md, ## Architecture)"


def test_only_the_cli_imports_the_cli():
    assert [f"{name} imports {dep}" for name in MODULES if name.split(".")[0] != "cli"
            for dep in IMPORTS[name] if dep.split(".")[0] == "cli"] == []


def test_the_package_has_no_import_cycles_type_checking_imports_included():
    cycles, state, stack = [], {}, []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for dep in sorted(IMPORTS[name]):     # TYPE_CHECKING imports included
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[name] = "done"

    for name in MODULES:
        if name not in state:
            visit(name)
    assert cycles == []


def _reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for dep in IMPORTS[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_each_shutdown_step_imports_nothing_from_the_steps_after_it():
    steps = [s for s in SHUTDOWN_STEPS if s in MODULES]  # shutdown/ may not be merged yet
    assert steps[:5] == SHUTDOWN_STEPS[:5]
    assert [f"{step} reaches {later}" for i, step in enumerate(steps)
            for later in steps[i + 1:] if later in _reachable(step)] == []


def _sys_modules_lookups(name: str) -> list[tuple[int, str | None]]:
    """(line, the module name looked up, or None when it is not one string) of every use of
    ``sys.modules`` in ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(
                a.name == "modules" for a in node.names):
            out.append((node.lineno, None))
        if not (isinstance(node, ast.Attribute) and node.attr == "modules"
                and isinstance(node.value, ast.Name) and node.value.id == "sys"):
            continue
        use = node
        while use in parents and not isinstance(use, (ast.Compare, ast.Call, ast.Subscript)):
            use = parents[use]
        keys = [c.value for c in ast.walk(use)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        out.append((node.lineno, keys[0] if len(keys) == 1 else None))
    return out


def test_no_module_sniffs_sys_modules_outside_the_allowlist():
    found = [f"{MODULES[name].relative_to(ROOT)}:{line}: sys.modules lookup of {key!r}"
             for name in MODULES if name not in PENDING_SNIFFERS
             for line, key in _sys_modules_lookups(name)
             if (name, key) not in SYS_MODULES_ALLOWED]
    assert found == [], ("behaviour must not depend on which modules the caller loaded; make it "
                         "an explicit option, or allowlist a lookup that only avoids an import")


def _design_picture_names() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    assert "\n## Architecture\n" in text, "docs/design.md has no ## Architecture section"
    section = text.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```\n(.*?)^```", section, re.M | re.S)
    assert blocks, "docs/design.md: no picture under ## Architecture"
    return {m for b in blocks for m in re.findall(r"(?<![\w./-])((?:\w+/)*\w+\.py)\b", b)}


def test_the_design_picture_names_only_modules_that_exist():
    files = {str(p.relative_to(PKG)) for p in MODULES.values()}
    pending = () if (PKG / "shutdown").is_dir() else ("shutdown/",)  # the run.py rewrite
    assert sorted(n for n in _design_picture_names()
                  if n not in files and not n.startswith(pending)) == []


def test_the_design_picture_names_every_module():
    names = _design_picture_names()
    missing = [str(p.relative_to(PKG)) for p in MODULES.values()
               if p.name not in ("__init__.py", "__main__.py")
               and str(p.relative_to(PKG)) not in names]
    assert missing == [], "add them to the picture in docs/design.md (## Architecture)"


def test_no_module_is_over_600_lines():
    # A concept decides where a file ends (issue 29): past 400 lines a module is worth a look
    # (a warning in the test report), past 600 it holds more than one job.
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in MODULES.values()}
    long = {name: n for name, n in sizes.items() if n > 600}
    assert long == {}, f"split these by job: {long}"
    for name, n in sorted(sizes.items()):
        if n > 400:
            warnings.warn(f"{name} has {n} lines: does it still hold one job?", stacklevel=1)


# Records: typed bags of what happened, filled in step by step by design; every other class of
# the package is a part, which gets what it needs through its constructor and whose attributes
# only its own module sets (issue 22). Class -> why it is a record.
# None is left: the run's parts are frozen and returned by its set-up (runstate/parts.py), its
# progress is a part of its own with a narrow API (runstate/progress.py), the shutdown steps
# return frozen results (shutdown/stages.py), and the exit table's Facts are built whole.
RECORDS: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def _tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text())


def _classes() -> dict[str, tuple[str, set[str]]]:
    """class name -> (its module, the attributes it owns: class-level names, methods, and
    ``self.x`` assigned in its methods)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for name in MODULES:
        for cls in ast.walk(_tree(name)):
            if not isinstance(cls, ast.ClassDef):
                continue
            attrs: set[str] = set()
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    attrs.add(node.target.id)
                elif isinstance(node, ast.Assign):
                    attrs |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    attrs.add(node.name)
                    attrs |= {t.attr for t in _stores(node) if _on_self(t)}
            out.setdefault(cls.name, (name, attrs))
    return out


@functools.lru_cache(maxsize=None)
def _frozen_classes() -> frozenset[str]:
    """Classes declared ``@dataclass(frozen=True)``: nothing can set their attributes after
    construction (Python raises), so their attribute names say nothing about who sets one."""
    return frozenset(
        cls.name for name in MODULES for cls in ast.walk(_tree(name))
        if isinstance(cls, ast.ClassDef) and any(
            isinstance(d, ast.Call) and any(k.arg == "frozen" and isinstance(k.value, ast.Constant)
                                            and k.value.value is True for k in d.keywords)
            for d in cls.decorator_list))


def _stores(tree: ast.AST) -> list[ast.Attribute]:
    """Every ``x.attr`` assigned to in ``tree`` (=, +=, annotated)."""
    return [t for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store) for t in [node]]


def _on_self(t: ast.Attribute) -> bool:
    return isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")


def _type_names(annotation: ast.AST | None) -> set[str]:
    """The class names an annotation mentions (``"RunState"``, ``Foo | None``)."""
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return set(re.findall(r"\b[A-Z]\w*", annotation.value))
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}


def _foreign_stores(name: str, classes: dict[str, tuple[str, set[str]]]) -> list[str]:
    """``x.attr = ...`` in module ``name`` that sets an attribute of another module's part.
    ``x``'s class is read from its annotation or its construction in the same function when
    it can be (an annotation that names only another package's classes: not a part of ours);
    otherwise from the attribute's name (owned by no class here nor any record, and no frozen
    class, whose attributes nobody can set)."""
    tree = _tree(name)
    returns = {f.name: _type_names(f.returns) for f in tree.body
               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own = {a for mod, attrs in classes.values() if mod == name for a in attrs}
    records = {a for cls in RECORDS for a in classes[cls][1]}
    parts_elsewhere = {a for cls, (mod, attrs) in classes.items()
                       if mod != name and cls not in RECORDS and cls not in _frozen_classes()
                       for a in attrs}
    found = []
    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))]:
        types: dict[str, set[str]] = {a.arg: _type_names(a.annotation)
                                      for a in func.args.args + func.args.kwonlyargs}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                f = node.value.func
                cls = f.id if isinstance(f, ast.Name) else \
                    f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                    else None
                made = {cls} if cls in classes else returns.get(cls or "", set())
                for t in node.targets:
                    if isinstance(t, ast.Name) and made:
                        types[t.id] = made
        for t in _stores(func):
            if _on_self(t) or t.attr in own:
                continue
            annotated = types.get(getattr(t.value, "id", ""), set()) - {"Any", "object"}
            known = {c for c in annotated if c in classes}
            if known:
                bad = any(c not in RECORDS and classes[c][0] != name for c in known)
            elif annotated:     # a class of another package's (torch's LaunchConfig): not ours
                bad = False
            else:
                bad = t.attr in parts_elsewhere and t.attr not in records
            if bad:
                found.append(f"{MODULES[name].relative_to(ROOT)}:{t.lineno}: {ast.unparse(t)}")
    return sorted(set(found))


def test_no_attribute_is_set_on_a_part_after_its_construction_by_another_module():
    classes = _classes()
    assert [s for name in MODULES for s in _foreign_stores(name, classes)] == [], \
        ("give the part what it needs through its constructor or a method of its own; only "
         "RECORDS are filled in from outside")


# ----- the run's directory has one owner (core/runpaths.py, issue 29 item 4)

RUNPATHS = "core.runpaths"
# The names of the run directory's entries, as a module would spell them to build a path: a
# string without whitespace (prose in a message or help text may name a file; it builds no
# path). Each matches the name itself, a prefix of it, or an f-string's piece of it.
ENTRY_NAMES = re.compile(
    r"(^|/)run\.json$|(^|/)\.lease($|\.)|ledger\.jsonl|pinned\.json|bad-nodes\.(json|lock)"
    r"|\.kempner_restarts\.json|(^|/)\.rescue($|/)|\.forced-exit\.|^\.trash-|^\.damaged-"
    r"|^\.kempner_probe|^step_($|\d|\(|\{)")
# (module, the string) -> why that module may spell it.
ENTRY_NAMES_ALLOWED = {
    ("supervise.channel", "run.json"): "the supervisor channel's own report, in its job-scoped "
                                       "directory: not an entry of the run's directory",
}
# (module, the expression whose ``.dir`` is read) -> why that is not the config's
# ``checkpoint.dir``. Everything else must take a RunPaths.
DIR_READS_ALLOWED = {
    ("config.schema", "self"): "the key's own definition: validated and made absolute there",
    ("rescue.files", "self"): "RescueFiles.dir: one rescue attempt's directory, from "
                              "RunPaths.rescue_attempt",
    ("rescue.rescuer", "self.files"): "the same RescueFiles.dir",
    ("cli.checkpoints", "args"): "the verb's DIR argument, a directory from outside the config "
                                 "(each checkpoint root found below it becomes a RunPaths)",
    ("cli.report", "args"): "the verb's DIR argument, made a RunPaths (or a ledger file)",
}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}


def _dir_reads(name: str) -> list[tuple[int, str]]:
    """(line, receiver) of every ``<receiver>.dir`` read in ``name``."""
    return [(n.lineno, ast.unparse(n.value)) for n in ast.walk(_tree(name))
            if isinstance(n, ast.Attribute) and n.attr == "dir" and isinstance(n.ctx, ast.Load)]


def test_only_runpaths_reads_checkpoint_dir_from_the_config():
    # RunPaths.from_config is the one way from the config to the run's directory: a module
    # that reads the key itself would build its own paths from it.
    assert [f"{name}:{line} reads {recv}.dir" for name in MODULES if name != RUNPATHS
            for line, recv in _dir_reads(name) if recv.endswith(".checkpoint")
            or recv == "checkpoint"] == [], "take a RunPaths (RunPaths.from_config(cfg))"


def test_no_module_but_runpaths_reads_a_directory_from_a_checkpoint_section():
    # A CheckpointConfig's ``dir`` is the same key reached one level down (``config.dir`` in a
    # module handed the section); no type is known from the source, so every ``.dir`` read is
    # listed, and those that are not the key are allowed by name with the reason.
    found = [f"{name}:{line} reads {recv}.dir" for name in MODULES if name != RUNPATHS
             for line, recv in _dir_reads(name) if (name, recv) not in DIR_READS_ALLOWED]
    assert found == [], "take a RunPaths (RunPaths.from_checkpoint_config(section))"
    stale = [k for k in DIR_READS_ALLOWED if k[0] not in MODULES
             or k[1] not in {recv for _, recv in _dir_reads(k[0])}]
    assert stale == [], "remove these allowances: nothing reads them any more"


def _entry_names(name: str) -> list[tuple[int, str]]:
    tree = _tree(name)
    docs = _docstrings(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and not any(c.isspace() for c in n.value) and ENTRY_NAMES.search(n.value)]


def test_no_module_but_runpaths_spells_an_entry_of_the_run_directory():
    # The names are on-disk format (existing runs' directories must keep working): spelled
    # once, in RunPaths, so that no module builds a path RunPaths does not know.
    found = [f"{name}:{line} spells {text!r}" for name in MODULES if name != RUNPATHS
             for line, text in _entry_names(name) if (name, text) not in ENTRY_NAMES_ALLOWED]
    assert found == [], "ask RunPaths for the path (add the entry there if it is new)"
    stale = [k for k in ENTRY_NAMES_ALLOWED
             if k[0] not in MODULES or k[1] not in {t for _, t in _entry_names(k[0])}]
    assert stale == [], "remove these allowances: nothing spells them any more"


def test_runpaths_imports_nothing_of_the_package():
    # core/, and below even config/: every layer that names an entry can import it.
    assert IMPORTS[RUNPATHS] == set()


# One decider: whether a job runs again, and with which code, is the policy's alone.
POLICY = "supervise.policy"
# The policy's answer and the requeue's word for it: no other module keeps a type of its own
# for the run-again question.
DECISION_TYPES = {"Decision", "Outcome"}
# (module, class) -> why that class answers another question.
DECISION_TYPES_ALLOWED = {
    ("checkresume.check", "Outcome"): "whether a resumed run matched an uninterrupted one",
}


def _decision_builds(name: str) -> list[int]:
    """Lines of ``name`` that call a ``Decision`` into being (``Decision(...)``,
    ``policy.Decision(...)``)."""
    return [n.lineno for n in ast.walk(_tree(name)) if isinstance(n, ast.Call)
            and ((isinstance(n.func, ast.Name) and n.func.id == "Decision")
                 or (isinstance(n.func, ast.Attribute) and n.func.attr == "Decision"))]


def test_no_decision_is_constructed_outside_the_policy():
    found = [f"{name}:{line} builds a Decision" for name in MODULES if name != POLICY
             for line in _decision_builds(name)]
    assert found == [], "give the policy the evidence (supervise/policy.Evidence) and decide()"


def test_no_module_but_the_policy_keeps_a_decision_type_of_its_own():
    found = [f"{name}: class {n.name}" for name in MODULES if name != POLICY
             for n in ast.walk(_tree(name)) if isinstance(n, ast.ClassDef)
             and n.name in DECISION_TYPES and (name, n.name) not in DECISION_TYPES_ALLOWED]
    assert found == [], "one decision type (supervise/policy.Decision), one verdict type " \
                        "(exitcodes.Verdict)"


# ----- the launch side's house (supervise/)

# The supervisors of ranks: one sub-package of supervise/ for each backend.
BACKENDS = ("srun", "torchrun", "local", "submitit", "ray")
CHANNEL = "supervise.channel"
RANK_SIDE = "supervise.rank"
# Modules besides the rank's side that read a channel from their environment -> why.
CHANNEL_READERS_ALLOWED = {
    "supervise.torchrun.wrapper": "a torchrun agent under the srun step loop: the channel of the "
                                  "supervisor above it, to give its workers one of their own",
}


# Documented import paths of launch code that moved into supervise/: each only re-exports.
PUBLIC_REEXPORTS = {"integrations.submitit": "supervise.submitit.jobs",
                    "integrations.ray_driver": "supervise.ray.driver",
                    "integrations.ray_actor": "supervise.ray.actor",
                    "integrations.ray_aio": "supervise.ray.aio",
                    "integrations.ray_board": "supervise.ray.board",
                    "integrations.ray_group": "supervise.ray.group",
                    "integrations.ray_supervise": "supervise.ray.relaunch"}


def test_every_launcher_of_ranks_lives_in_a_backend_of_supervise():
    backends = {p.name for p in (PKG / "supervise").iterdir() if (p / "__init__.py").is_file()}
    assert backends == set(BACKENDS)
    assert sorted(n for n in MODULES if n.split(".")[0] == "integrations"
                  and re.search(r"torchrun|submitit|ray_|local|warm|launch", n)
                  and n not in PUBLIC_REEXPORTS) == []
    assert {n: IMPORTS[n] for n in PUBLIC_REEXPORTS} == {n: {m} for n, m in
                                                          PUBLIC_REEXPORTS.items()}
    assert [n for n in PUBLIC_REEXPORTS if len(MODULES[n].read_text().splitlines()) > 15] == []


def test_slurm_imports_nothing_from_the_supervisors():
    # slurm/ is what SLURM itself is (environment, scontrol, clock, templates, preflight, bad
    # nodes, the scheduler's requeue); the supervisors build on it, never the other way. Of
    # supervise/ it asks only the pure policy, which decides the requeue as it decides the rest.
    found = [f"{name} imports {dep}" for name in MODULES if name.split(".")[0] == "slurm"
             for dep in sorted(IMPORTS[name]) if dep.split(".")[0] == "supervise" and dep != POLICY]
    assert found == [], "move it to its backend in supervise/, or ask the policy"


def test_a_rank_reads_its_supervisors_channel_through_one_module():
    # What a rank runs (the run layer) asks supervise/rank.py; the channel's format
    # (supervise/channel.py) is the supervisors' and the rank side's alone.
    found = [f"{name or '__init__'} imports {CHANNEL}" for name in MODULES
             if _layer(name) == "run" and CHANNEL in IMPORTS[name]]
    assert found == [], f"ask {RANK_SIDE}"


def _channel_reads(name: str) -> list[int]:
    """Lines of ``name`` that read a channel from the environment (``Channel.from_env``)."""
    return [n.lineno for n in ast.walk(_tree(name)) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == "from_env"
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "Channel"]


def test_only_the_rank_side_reads_the_channel_from_the_environment():
    found = [f"{name}:{line}" for name in MODULES
             if name not in (CHANNEL, RANK_SIDE, *CHANNEL_READERS_ALLOWED)
             for line in _channel_reads(name)]
    assert found == [], f"a rank asks {RANK_SIDE}"
    stale = [k for k in CHANNEL_READERS_ALLOWED if k not in MODULES or not _channel_reads(k)]
    assert stale == [], "remove these allowances: nothing reads a channel there any more"
