"""docs/internals.md names only files, functions, classes, attributes and settings that exist.

The page walks a block's life file by file; a rename that leaves it behind sends a newcomer to
code that is not there. Every backticked span that looks like a code name is checked against
the source: a path must exist, `Class.member` must be defined on that class (a method, class
attribute or an attribute its methods assign), `module.name` in that module, a dotted
lower-case setting (`host.commit_check`) in kvstore/default.toml, and a bare function,
class or constant name somewhere in the daemon, the tiers or the SDK.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "internals.md"
SOURCES = [ROOT / "kvstore", ROOT / "tiers", ROOT / "client" / "kvstore_client"]
SPAN = re.compile(r"`([^`\n]+)`")
IDENT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
MIN_CHECKED = 150           # the page cites at least this many names (it cannot go vacuous)


@dataclass
class Defined:
    names: set[str] = field(default_factory=set)              # anything defined anywhere
    members: set[tuple[str, str]] = field(default_factory=set)   # (class, member)
    modules: dict[str, set[str]] = field(default_factory=dict)   # dotted and short name


def _collect(path: Path, base: Path, out: Defined) -> None:
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(base).with_suffix("")
    dotted = ".".join(rel.parts if rel.name != "__init__" else rel.parts[:-1])
    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
        for t in _targets(node):
            top.add(t)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top.update((a.asname or a.name).split(".")[0] for a in node.names)
    for key in {dotted, dotted.rsplit(".", 1)[-1]}:
        out.modules.setdefault(key, set()).update(top)
    out.names |= top
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.isidentifier():
            out.names.add(node.value)        # counter and field names live in strings
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.names.add(node.name)
            a = node.args
            out.names.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
        if isinstance(node, ast.ClassDef):
            out.names.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.members.add((node.name, item.name))
                for t in _targets(item):
                    out.members.add((node.name, t))
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    out.members.add((node.name, sub.attr))
                    out.names.add(sub.attr)
            out.names.update(m for c, m in out.members if c == node.name)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        found = []
        for t in node.targets:
            found += [e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                      if isinstance(e, ast.Name)]
        return found
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def defined() -> Defined:
    out = Defined()
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            if "_proto" in path.parts:
                continue
            _collect(path, src.parent, out)
    return out


def _settings() -> dict:
    return tomllib.loads((ROOT / "kvstore" / "default.toml").read_text())


def _is_setting(parts: list[str], settings: dict) -> bool:
    node: object = settings
    for p in parts:
        if not isinstance(node, dict) or p not in node:
            return False
        node = node[p]
    return True


def problems(text: str, d: Defined, settings: dict) -> tuple[list[str], int]:
    """(what is cited but not there, how many spans were checked)."""
    bad: list[str] = []
    checked = 0
    for raw in SPAN.findall(text):
        span = raw.strip()
        if any(c in span for c in "<>\"' "):
            continue
        if "/" not in span and re.search(r"\.(dat|img|md|toml|json|sock)$", span):
            continue                          # a file the daemon makes, not one in the repo
        if "/" in span or span.endswith(".py"):
            if not any((base / span).exists() for base in (ROOT, ROOT / "client")):
                bad.append(f"{span}: no such file or folder")
            checked += 1
            continue
        name = re.sub(r"\(.*\)$", "", re.sub(r"\[.*\]$", "", span))
        called = name != span and span.endswith(")")
        if not IDENT.match(name):
            continue
        parts = name.split(".")
        if len(parts) == 1:
            word = parts[0]
            looks_code = (called or "_" in word or word.isupper()
                          or (word[0].isupper() and any(c.islower() for c in word[1:])))
            if not looks_code:
                continue
            checked += 1
            if word not in d.names and word not in d.modules:
                bad.append(f"{span}: defined nowhere")
            continue
        checked += 1
        head, member = parts[0], parts[1]
        if head[0].isupper():
            if (head, member) not in d.members:
                bad.append(f"{span}: {head} has no {member}")
        elif name in d.modules or _is_setting(parts, settings):
            pass
        elif head in settings:
            bad.append(f"{span}: no such setting in kvstore/default.toml")
        elif head in d.modules:
            if member not in d.modules[head]:
                bad.append(f"{span}: module {head} defines no {member}")
        elif parts[-1] not in d.names:
            bad.append(f"{span}: neither a setting nor a name defined anywhere")
    return bad, checked


def test_every_name_the_internals_page_cites_exists():
    bad, checked = problems(DOC.read_text(), defined(), _settings())
    assert not bad, "docs/internals.md cites what the code does not have:\n" + "\n".join(bad)
    assert checked >= MIN_CHECKED, f"only {checked} names checked: is the page still a walk?"


def test_the_check_finds_names_that_do_not_exist():
    text = ("`kvstore/moves/host_to_ssd.py` `HostToSSD.put` `host.commit_check` "
            "`kvstore/movement.py` `HostToSSD.no_such_method` `StoreState.nothing` "
            "`ssd.no_such_setting` `no_such_function()` `NoSuchClass` `getcopy.nothing`")
    bad, checked = problems(text, defined(), _settings())
    assert checked == 10
    assert [b.split(":")[0] for b in bad] == [
        "kvstore/movement.py", "HostToSSD.no_such_method", "StoreState.nothing",
        "ssd.no_such_setting", "no_such_function()", "NoSuchClass", "getcopy.nothing"]
