"""Reading a loop file: YAML with the line of every key kept, and one-line errors.

PyYAML is imported here, lazily, the first time a file is read: importing
`adapters.loop` (or `kernel --help`) never pays for it.

Two deliberate departures from PyYAML's defaults, both so that loop files
mean what they look like:

- Booleans are YAML 1.2 style: only `true`/`false`. Under YAML 1.1, a route
  table `{yes: done, no: fix}` would have the *booleans* True/False as keys,
  and a state called `on` or `off` would silently become a boolean.
- A key repeated in one mapping is an error (PyYAML keeps the last one).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any


class Located(dict[Any, Any]):
    """A YAML mapping that remembers its own line and the line of each key (1-based)."""

    __slots__ = ("key_lines", "line")

    def __init__(self) -> None:
        super().__init__()
        self.line: int | None = None
        self.key_lines: dict[Any, int] = {}


class YamlError(Exception):
    """The text is not YAML (or repeats a key); `line` is 1-based when known."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None,
                 *, syntax: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.syntax = syntax
        self.line = line
        self.column = column


@cache
def _loader() -> type[Any]:
    import yaml
    from yaml.constructor import ConstructorError
    from yaml.resolver import BaseResolver

    class Loader(yaml.SafeLoader):
        """SafeLoader with located mappings, YAML 1.2 booleans and no duplicate keys."""

    # Replace the YAML 1.1 boolean resolver (yes/no/on/off) by true/false only.
    resolvers = {
        first: [(tag, rx) for tag, rx in entries if tag != "tag:yaml.org,2002:bool"]
        for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.yaml_implicit_resolvers = resolvers
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
        list("tTfF"))

    def construct_mapping(loader: Any, node: Any) -> Located:
        loader.flatten_mapping(node)
        mapping = Located()
        mapping.line = node.start_mark.line + 1
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise ConstructorError(None, None, "a mapping key must be a plain value",
                                       key_node.start_mark) from None
            if key in mapping:
                raise ConstructorError(None, None, f"key {key!r} appears twice in one mapping",
                                       key_node.start_mark)
            mapping[key] = loader.construct_object(value_node, deep=True)
            mapping.key_lines[key] = key_node.start_mark.line + 1
        return mapping

    Loader.add_constructor(BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


#: How large a document may become once its aliases are expanded, in
#: characters of scalars plus one per node. A loop file is at most 1 MiB, so
#: only aliases can go past this; an "alias bomb" (a billion laughs) does.
MAX_EXPANDED = 4 << 20


def load_yaml(text: str) -> Any:
    """Parse `text` as one YAML document; raise `YamlError` with a one-line message."""
    import yaml

    loader: Any = None
    try:
        loader = _loader()(text)  # a SafeLoader subclass
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(part for part in (exc.context, exc.problem) if part) or "invalid YAML"
        raise YamlError(_one_line(what), mark.line + 1 if mark else None,
                        mark.column + 1 if mark else None) from None
    except yaml.YAMLError as exc:
        raise YamlError(_one_line(str(exc) or "invalid YAML")) from None
    except RecursionError:
        raise YamlError("the document is nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_expansion(root: Any) -> None:
    """Refuse a document whose aliases expand it past `MAX_EXPANDED`, or refer to themselves.

    PyYAML builds an alias as a second reference to one object, so loading is
    cheap; but everything that later walks the value (rendering it as JSON,
    writing it to the audit) pays for the expanded size.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise YamlError("an alias refers to the node that contains it",
                            node.start_mark.line + 1, node.start_mark.column + 1, syntax=False)
        active.add(key)
        if isinstance(node.value, str):
            total = 1 + len(node.value)
        else:
            total = 1
            for item in node.value:
                for child in item if isinstance(item, tuple) else (item,):
                    total += size(child)
                    if total > MAX_EXPANDED:
                        raise YamlError(
                            f"the document's aliases expand it past {MAX_EXPANDED} characters "
                            "(an alias bomb?)", child.start_mark.line + 1,
                            child.start_mark.column + 1, syntax=False)
        active.discard(key)
        sizes[key] = total
        return total

    size(root)


def _one_line(text: str) -> str:
    return " ".join(text.split())
