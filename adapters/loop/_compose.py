"""Composition, as little-loops writes it: `from:` inheritance and `import:`/`fragments:`.

Both are resolved on the loaded YAML, before the loop is parsed, so the
parser and the checks see one plain loop:

- `from: lib/base` deep-merges the named loop (the parent, itself resolved
  first) under this one: mappings (`context`, `states`, ...) merge key by key,
  anything else in the child replaces the parent's. A cycle or a missing
  parent is an error at the `from:` line.
- `import: [lib/common.yaml]` loads the `fragments:` of each library (later
  ones win), the loop's own `fragments:` go on top, and every state with
  `fragment: NAME` gets that fragment deep-merged under its own keys. A
  fragment's `parameters:` travel with the state (for `${param.*}` and
  `with:`); its `description` does not.

Files are found relative to the loop that names them, then in the
directories above it (little-loops falls back to its built-in catalogue the
same way), with `.yaml`/`.yml` optional. What comes from another file has no
line there: it is reported at the line of the `from:` or `fragment:` key that
brought it in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._spec import Problem, deep_merge
from ._yaml import Located

#: How far above a loop's directory names are looked up.
SEARCH_UP = 3

#: Reads a YAML file: (data, None) or (None, why not).
Reader = Callable[[Path], tuple[Any, str | None]]


def find_loop_file(base: Path, ref: str) -> Path | None:
    """The file `ref` names, relative to `base` (a directory), then the directories above.

    None when there is none, including for a name that cannot name a file (empty,
    `.`, `/`, `~user` of no such user): the callers say "not found", never raise.
    """
    try:
        rel = Path(ref).expanduser()
    except (RuntimeError, ValueError):  # `~nobody/x`: no such user's home
        return None
    roots = [rel] if rel.is_absolute() else [
        d / rel for d in [base, *list(base.parents)[:SEARCH_UP]]]
    for root in roots:
        if not root.name:
            continue  # `.`, `/`: a directory, and no `.yaml` beside it to try
        for candidate in (root, root.with_name(root.name + ".yaml"),
                          root.with_name(root.name + ".yml")):
            if candidate.is_file():
                return candidate
    return None


def not_a_file(base: Path, ref: str) -> str:
    """What `ref` names instead of a loop file, for a "not found" error: `' (/dev/zero is
    not a regular file)'`, `' (/tmp is a directory)'`, or '' (nothing there at all)."""
    try:
        rel = Path(ref).expanduser()
    except (RuntimeError, ValueError):
        return ""
    roots = [rel] if rel.is_absolute() else [
        d / rel for d in [base, *list(base.parents)[:SEARCH_UP]]]
    for root in roots:
        if root.is_dir():
            return f" ({root} is a directory)"
        if root.exists() and not root.is_file():
            return f" ({root} is not a regular file)"
    return ""


class Composer:
    """Resolves `from:` and fragments for one loop file, recording problems."""

    def __init__(self, path: Path, read: Reader) -> None:
        self.path = path
        self.read = read
        self.problems: list[Problem] = []

    def error(self, data: Any, key: str, where: str, message: str) -> None:
        line = data.key_lines.get(key) if isinstance(data, Located) else None
        self.problems.append(Problem("error", where, message, str(self.path), line))

    def resolve(self, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = self.inherit(data, self.path, (self.path.resolve(),))
        return self.fragments(data)

    # -- from:

    def inherit(self, data: Mapping[Any, Any], path: Path,
                seen: tuple[Path, ...]) -> Mapping[Any, Any]:
        if "from" not in data:
            return data
        ref = data["from"]
        child = Located()
        child.line = getattr(data, "line", None)
        for key, value in data.items():
            if key != "from":
                child[key] = value
                if isinstance(data, Located) and key in data.key_lines:
                    child.key_lines[key] = data.key_lines[key]
        if not isinstance(ref, str) or not ref.strip():
            self.error(data, "from", "from", "expected the name of the loop to extend")
            return child
        parent_path = find_loop_file(path.parent, ref)
        if parent_path is None:
            self.error(data, "from", "from", f"loop '{ref}' not found (looked in "
                                             f"{path.parent} and the directories above)")
            return child
        if parent_path.resolve() in seen:
            chain = " -> ".join(p.name for p in (*seen, parent_path))
            self.error(data, "from", "from", f"'from:' forms a cycle: {chain}")
            return child
        parent, why = self.read(parent_path)
        if why is not None or not isinstance(parent, Mapping):
            self.error(data, "from", "from", f"cannot use '{ref}': "
                                             f"{why or 'it is not a mapping of keys'}")
            return child
        parent = self.inherit(parent, parent_path, (*seen, parent_path.resolve()))
        line = data.key_lines.get("from") if isinstance(data, Located) else None
        return deep_merge(relocate(parent, line), child)

    # -- import: / fragments: / fragment:

    def fragments(self, data: Mapping[Any, Any]) -> Mapping[Any, Any]:
        library: dict[str, Any] = {}
        imports = data.get("import")
        if imports is not None and not isinstance(imports, list):
            self.error(data, "import", "import", "expected a list of fragment library files")
            imports = []
        for i, ref in enumerate(imports or ()):
            where = f"import.{i}"
            lib_path = find_loop_file(self.path.parent, str(ref)) if isinstance(ref, str) \
                else None
            if lib_path is None:
                self.error(data, "import", where, f"fragment library '{ref}' not found "
                                                  f"(looked in {self.path.parent} and above)")
                continue
            lib, why = self.read(lib_path)
            if why is not None or not isinstance(lib, Mapping):
                self.error(data, "import", where, f"cannot use '{ref}': "
                                                  f"{why or 'it is not a mapping of keys'}")
                continue
            found = lib.get("fragments")
            if isinstance(found, Mapping):
                line = data.key_lines.get("import") if isinstance(data, Located) else None
                library.update({str(k): relocate(v, line) for k, v in found.items()})
        local = data.get("fragments")
        if local is not None and not isinstance(local, Mapping):
            self.error(data, "fragments", "fragments", "expected a mapping of name -> fragment")
        elif local is not None:
            library.update({str(k): v for k, v in local.items()})
        states = data.get("states")
        if not isinstance(states, Mapping) or not any(
                isinstance(s, Mapping) and "fragment" in s for s in states.values()):
            return data
        out_states = Located()
        out_states.line = getattr(states, "line", None)
        if isinstance(states, Located):
            out_states.key_lines.update(states.key_lines)
        for name, body in states.items():
            out_states[name] = self.expand(str(name), body, library)
        out = Located()
        out.line = getattr(data, "line", None)
        out.update(data)
        if isinstance(data, Located):
            out.key_lines.update(data.key_lines)
        out["states"] = out_states
        return out

    def expand(self, name: str, body: Any, library: Mapping[str, Any]) -> Any:
        if not isinstance(body, Mapping) or "fragment" not in body:
            return body
        ref = body["fragment"]
        where = f"states.{name}.fragment"
        if not isinstance(ref, str) or ref not in library:
            known = ", ".join(sorted(library)) or "none; add import: or fragments:"
            self.error(body, "fragment", where, f"fragment {ref!r} is not defined "
                                                f"(known: {known})")
            return body
        fragment = library[ref]
        if not isinstance(fragment, Mapping):
            self.error(body, "fragment", where, f"fragment '{ref}' is not a mapping")
            return body
        base = Located()
        base.line = getattr(fragment, "line", None)
        for key, value in fragment.items():
            if key not in ("description", "parameters"):
                base[key] = value
                if isinstance(fragment, Located) and key in fragment.key_lines:
                    base.key_lines[key] = fragment.key_lines[key]
        own = Located()
        own.line = getattr(body, "line", None)
        for key, value in body.items():
            if key != "fragment":
                own[key] = value
                if isinstance(body, Located) and key in body.key_lines:
                    own.key_lines[key] = body.key_lines[key]
        merged = deep_merge(base, own)
        if "parameters" in fragment:
            merged["fragment_parameters"] = fragment["parameters"]
            merged.key_lines["fragment_parameters"] = (
                body.key_lines.get("fragment") if isinstance(body, Located) else None) or 0
        merged["fragment_name"] = ref
        if isinstance(body, Located) and "fragment" in body.key_lines:
            merged.key_lines["fragment_name"] = body.key_lines["fragment"]
        return merged


def relocate(obj: Any, line: int | None) -> Any:
    """A copy of `obj` whose mappings all report `line` (they came from another file)."""
    if isinstance(obj, Mapping):
        out = Located()
        out.line = line
        for key, value in obj.items():
            out[key] = relocate(value, line)
            if line is not None:
                out.key_lines[key] = line
        return out
    if isinstance(obj, list):
        return [relocate(v, line) for v in obj]
    return obj
