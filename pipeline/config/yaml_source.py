"""Read a pipeline YAML file into plain data plus the ``file:line`` of every key path.

PyYAML's composer gives nodes with marks; this module turns them into plain values (str, int,
float, bool, None, lists, str-keyed dicts) itself, so nothing can construct Python objects, and
records where each key sits so later checks can say ``pipeline.yaml:12``. It also applies
command-line overrides (``stages.learner.replicas=2``; ``stages.scorer.rewards.0.fn=x`` indexes
a list, ``stages.scorer.rewards+={fn: x}`` appends to one) and writes YAML back (``dump_yaml``).

Differences from plain ``yaml.safe_load``, each deliberate: duplicate keys are errors (PyYAML
keeps the last silently); ``1e-3`` is a float as in YAML 1.2 (PyYAML 1.1 reads it as a string);
dates stay strings; tags other than the core ones (``!!python/object``, ``!!binary``, ``!foo``)
are rejected. Checking values against the config's types is ``pipeline.config.typed``'s job.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from pipeline.config.errors import ConfigError, ConfigIssue

__all__ = ["Locations", "apply_overrides", "dump_yaml", "join_path", "load_yaml", "parent_path"]

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_CORE + t for t in ("str", "int", "float", "bool", "null")}
_MERGE_TAG = _CORE + "merge"
_FLOAT_EXPONENT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")


def _tune_resolvers(cls: type[yaml.resolver.BaseResolver]) -> None:
    # Own copy of the resolver table: no timestamps (dates stay strings, no datetime objects),
    # and YAML 1.2 floats without a dot (1e-3), which PyYAML would otherwise read as strings.
    cls.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != _CORE + "timestamp"]
        for first, resolvers in cls.yaml_implicit_resolvers.items()
    }
    cls.add_implicit_resolver(_CORE + "float", _FLOAT_EXPONENT, list("-+0123456789"))


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_tune_resolvers(_Loader)
_tune_resolvers(_Dumper)  # so strings the loader would read as numbers get quoted


def join_path(path: str, key: str) -> str:
    """``join_path("stages", "a")`` is ``"stages.a"``; the root path is ``""``."""
    return f"{path}.{key}" if path else key


def parent_path(path: str) -> str:
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else ""


class Locations:
    """Where each dotted key path was written: ``file.yaml:LINE`` or ``override 'TEXT'``.

    ``at(path)`` answers for a path that was never written (a missing key) with its nearest
    written ancestor, and with the file itself for the root.
    """

    def __init__(self, file: str = "") -> None:
        self.file = file
        self._where: dict[str, str] = {}

    def set(self, path: str, where: str) -> None:
        self._where[path] = where

    def at(self, path: str) -> str:
        while path:
            if path in self._where:
                return self._where[path]
            path = parent_path(path)
        return self._where.get("", self.file)

    def drop_under(self, path: str) -> None:
        """Forget ``path`` and everything below it (the value there was replaced)."""
        for key in [k for k in self._where if _is_under(k, path)]:
            del self._where[key]

    def renumber_after_removal(self, path: str, index: int) -> None:
        """Item ``index`` of the list at ``path`` was removed: later items move up by one."""
        prefix = path + "["
        moved = {}
        for key in [k for k in self._where if k.startswith(prefix)]:
            number, close, rest = key[len(prefix) :].partition("]")
            if close and number.isdigit() and int(number) > index:
                moved[f"{prefix}{int(number) - 1}]{rest}"] = self._where.pop(key)
        self._where.update(moved)

    def __contains__(self, path: object) -> bool:
        return path in self._where


def _is_under(key: str, path: str) -> bool:
    return not path or key == path or key.startswith((path + ".", path + "["))


def _show_tag(tag: str) -> str:
    return "!!" + tag[len(_CORE) :] if tag.startswith(_CORE) else tag


class _NodeReader:
    """Turns composed nodes into plain data, recording locations and collecting issues."""

    def __init__(self, loader: _Loader, locations: Locations, where: str | None = None) -> None:
        self.loader = loader
        self.locations = locations
        self.fixed_where = where  # overrides: every path reports at the override's text
        self.issues: list[ConfigIssue] = []
        self._open: set[int] = set()  # collections being read: an alias back into one loops

    def where(self, node: Node) -> str:
        if self.fixed_where is not None:
            return self.fixed_where
        return f"{self.locations.file}:{node.start_mark.line + 1}"

    def issue(self, path: str, node: Node, message: str) -> None:
        self.issues.append(ConfigIssue(path, message, self.where(node)))

    def read(self, node: Node, path: str) -> Any:
        if isinstance(node, (MappingNode, SequenceNode)):
            if id(node) in self._open:
                self.issue(path, node, "an alias refers back to a collection that contains it")
                return None
            self._open.add(id(node))
            try:
                return self._collection(node, path)
            finally:
                self._open.discard(id(node))
        if node.tag not in _SCALAR_TAGS:
            return self._bad_tag(node, path)
        return self.loader.construct_object(node)

    def _collection(self, node: MappingNode | SequenceNode, path: str) -> Any:
        if isinstance(node, MappingNode):
            return self._mapping(node, path, seen={})
        if node.tag != _CORE + "seq":
            return self._bad_tag(node, path)
        items = []
        for i, item in enumerate(node.value):
            self.locations.set(f"{path}[{i}]", self.where(item))
            items.append(self.read(item, f"{path}[{i}]"))
        return items

    def _bad_tag(self, node: Node, path: str) -> None:
        self.issue(
            path,
            node,
            f"unsupported YAML tag {_show_tag(node.tag)!r}: only plain values "
            "(strings, numbers, booleans, null, lists, mappings) are allowed",
        )
        return None

    def _mapping(self, node: MappingNode, path: str, seen: dict[str, Node]) -> dict[str, Any]:
        if node.tag != _CORE + "map":
            self._bad_tag(node, path)
            return {}
        result: dict[str, Any] = {}
        merges: list[Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merges.append(value_node)
                continue
            key = self._key(key_node, path)
            if key is None:
                continue
            sub = join_path(path, key)
            if key in seen:
                first = seen[key].start_mark.line + 1
                self.issue(
                    sub,
                    key_node,
                    f"duplicate key {key!r} (first at line {first}, again at "
                    f"line {key_node.start_mark.line + 1}): YAML would keep "
                    "only the last one; remove one of them",
                )
                continue
            seen[key] = key_node
            self.locations.set(sub, self.where(key_node))
            result[key] = self.read(value_node, sub)
        for merged in self._merged(merges, path):  # `<<: *defaults`; own keys win
            for key, value in merged.items():
                result.setdefault(key, value)
        return result

    def _merged(self, merges: list[Node], path: str) -> list[dict[str, Any]]:
        sources: list[Node] = []
        for node in merges:
            sources.extend(node.value if isinstance(node, SequenceNode) else [node])
        out = []
        for source in sources:
            if not isinstance(source, MappingNode):
                self.issue(path, source, "a merge key '<<' needs a mapping (or a list of them)")
                continue
            # Read into scratch locations so merged keys never hide where own keys were written.
            scratch = Locations(self.locations.file)
            reader = _NodeReader(self.loader, scratch, self.fixed_where)
            out.append(reader._mapping(source, path, seen={}))
            self.issues.extend(reader.issues)
            for sub, where in scratch._where.items():
                if sub not in self.locations:
                    self.locations.set(sub, where)
        return out

    def _key(self, node: Node, path: str) -> str | None:
        if not isinstance(node, ScalarNode):
            kind = "mapping" if isinstance(node, MappingNode) else "list"
            self.issue(path, node, f"a key must be a string, got a {kind}")
            return None
        if node.tag not in _SCALAR_TAGS:
            return self._bad_tag(node, path)
        value = self.read(node, path)
        if isinstance(value, str):
            return value
        shown = "null" if value is None else f"{value!r} ({type(value).__name__})"
        self.issue(
            join_path(path, str(node.value)),
            node,
            f"key {node.value!r} is read by YAML as {shown}, not a string: "
            f"quote it ('{node.value}': ...)",
        )
        return None


_PLAIN_PROBLEMS = (
    (
        "mapping values are not allowed",
        "unexpected ':' here: quote a value that contains ': ', "
        "or check this line's indentation and that the line above has its ':'",
    ),
    (
        "could not find expected ':'",
        "expected 'key: value' (a ':' is missing after a key, or a quote is not closed)",
    ),
    ("expected <block end>", "this line's indentation does not line up with the lines above"),
    ("found unexpected end of stream", "the file ends inside an unclosed quote"),
    ("expected ',' or ']'", "a '[' list is not closed, or its items lack ', ' between them"),
    ("expected ',' or '}'", "a '{' mapping is not closed, or its items lack ', ' between them"),
    (
        "but found another document",
        "the file holds more than one YAML document ('---'); a pipeline file is a single document",
    ),
    ("found character '\\t'", "a tab character here: YAML needs spaces, not tabs"),
    ("found undefined alias", "an alias '*NAME' refers to an anchor '&NAME' not defined above"),
)


def _yaml_error_message(exc: yaml.MarkedYAMLError) -> str:
    problem = exc.problem or str(exc)
    plain = next((words for key, words in _PLAIN_PROBLEMS if key in problem), None)
    parser = problem
    if exc.context and exc.context_mark is not None:
        parser += f", {exc.context} at line {exc.context_mark.line + 1}"
    elif exc.context:
        parser += f", {exc.context}"
    return f"invalid YAML: {plain} (parser: {parser})" if plain else f"invalid YAML: {parser}"


def _compose(text: str) -> tuple[_Loader, Node | None]:
    loader = _Loader(text)
    try:
        return loader, loader.get_single_node()
    finally:
        loader.dispose()


_TAB_INDENT = re.compile(r"^[ ]*\t")


def _syntax_issues(text: str, file: str, exc: yaml.YAMLError) -> list[ConfigIssue]:
    issues = []
    tab_lines = set()
    for number, line in enumerate(text.splitlines(), start=1):
        match = _TAB_INDENT.match(line)
        if match and line.strip():
            tab_lines.add(number)
            issues.append(
                ConfigIssue(
                    "",
                    "a tab character is used for indentation: YAML "
                    "indentation must be spaces (replace the tab with spaces)",
                    f"{file}:{number}:{match.end()}",
                )
            )
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        issues.append(ConfigIssue("", f"invalid YAML: {exc}", file))
    elif exc.problem_mark.line + 1 not in tab_lines:
        mark = exc.problem_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}"
        issues.append(ConfigIssue("", _yaml_error_message(exc), where))
    return issues


def _read_text(path: Path, file: str) -> str:
    def fail(message: str) -> ConfigError:
        return ConfigError([ConfigIssue("", message, file)], file)

    if path.is_dir():
        raise fail("is a directory, not a YAML file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        siblings = (
            [p.name for p in path.parent.iterdir() if p.suffix in (".yaml", ".yml")]
            if path.parent.is_dir()
            else []
        )
        close = difflib.get_close_matches(path.name, siblings, n=1)
        hint = f"; did you mean {str(path.with_name(close[0]))!r}?" if close else ""
        raise fail(f"no such file{hint}") from None
    except OSError as exc:
        raise fail(f"cannot read the file: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise fail(f"not a UTF-8 text file (undecodable byte at offset {exc.start})") from None


def load_yaml(path: str | Path) -> tuple[dict[str, Any], Locations, list[ConfigIssue]]:
    """The top-level mapping of the file at ``path``, where each key path sits, and problems.

    Raises ConfigError when nothing can be checked further (missing, unreadable, empty or
    malformed file, top level not a mapping); returns the other problems (duplicate or
    non-string keys, unsupported tags) so the caller reports them with its own.
    """
    path = Path(path)
    file = str(path)
    text = _read_text(path, file)
    try:
        loader, node = _compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_syntax_issues(text, file, exc), file) from None
    if node is None:
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    "the file is empty (or holds only comments): expected "
                    "the sections run, transport, stages",
                    file,
                )
            ],
            file,
        )
    if not isinstance(node, MappingNode):
        got = "a list" if isinstance(node, SequenceNode) else f"the scalar {node.value!r}"
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    "the top level must be a mapping of sections (run, "
                    f"transport, stages), got {got}",
                    f"{file}:{node.start_mark.line + 1}",
                )
            ],
            file,
        )
    locations = Locations(file)
    reader = _NodeReader(loader, locations)
    data = reader.read(node, "")
    return data, locations, reader.issues


def _override_value(text: str, value_text: str) -> tuple[Any, list[ConfigIssue]]:
    where = f"override {text!r}"
    try:
        loader, node = _compose(value_text)
    except yaml.YAMLError as exc:
        problem = (
            _yaml_error_message(exc)
            if isinstance(exc, yaml.MarkedYAMLError)
            else f"invalid YAML: {exc}"
        )
        return None, [ConfigIssue("", f"the value is not valid YAML: {problem}", where)]
    if node is None:
        return None, []
    if isinstance(node, (MappingNode, SequenceNode)) and not node.flow_style:
        return None, [
            ConfigIssue(
                "",
                "the value reads as a block YAML collection: write a "
                "mapping as {k: v} or a list as [a, b], or quote a string",
                where,
            )
        ]
    reader = _NodeReader(loader, Locations(), where)
    value = reader.read(node, "")
    return value, reader.issues


def _describe(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "a mapping"
    return f"{value!r} ({type(value).__name__})"


_APPEND_SUFFIXES = ("[+]", ".+", "+")  # KEY+=VALUE (also KEY.+= and KEY[+]=): append to a list
_BRACKET_INDEX = re.compile(r"\[(\d+)\]")


def _key_parts(key: str) -> list[str] | None:
    """``a.b[0].c`` or ``a.b.0.c`` as ``["a", "b", "0", "c"]``; None when malformed."""
    dotted = _BRACKET_INDEX.sub(r".\1", key)
    parts = dotted.split(".")
    if not key or not all(parts) or any(c in dotted for c in "[]"):
        return None
    return parts


def _show_index_range(path: str, items: list[Any]) -> str:
    if not items:
        return f"{path} is an empty list"
    count = f"{len(items)} item" + ("" if len(items) == 1 else "s")
    return f"{path} has {count} (indexes 0 to {len(items) - 1})"


class _Walk:
    """Follows an override's key parts through mappings and lists, keeping the key path."""

    def __init__(self, key: str, where: str, locations: Locations) -> None:
        self.key = key
        self.where = where
        self.locations = locations
        self.issue: ConfigIssue | None = None

    def fail(self, message: str) -> None:
        self.issue = ConfigIssue(self.key, message, self.where)

    def index(self, items: list[Any], part: str, path: str) -> int | None:
        """The list index ``part`` names in ``items`` (at key path ``path``), or None."""
        if not part.isdigit():
            self.fail(
                f"{path} is a list: index it with a number ({path}.0 is its first item), "
                f"or append to it with {path}+=VALUE"
            )
            return None
        i = int(part)
        if i >= len(items):
            self.fail(
                f"index {i} is out of range: {_show_index_range(path, items)}; "
                f"append with {path}+=VALUE"
            )
            return None
        return i

    def descend(self, target: Any, parts: list[str], create: bool) -> tuple[Any, str] | None:
        """The container that ``parts`` lead to from ``target`` and its key path.

        ``create``: missing (or null) mapping entries on the way become empty mappings.
        """
        path = ""
        for part in parts:
            if isinstance(target, list):
                i = self.index(target, part, path)
                if i is None:
                    return None
                path = f"{path}[{i}]"
                child = target[i]
            elif isinstance(target, dict):
                path = join_path(path, part)
                child = target.get(part)
                if child is None:
                    if not create:
                        self.fail("nothing there: the config has no such key")
                        return None
                    child = target[part] = {}
                    self.locations.drop_under(path)
                    self.locations.set(path, self.where)
            else:  # never: a scalar is refused below before the walk steps into it
                return None
            if not isinstance(child, (dict, list)):
                if not create:
                    self.fail("nothing there: the config has no such key")
                    return None
                self.fail(
                    f"cannot set a key inside {path!r}: it is {_describe(child)}, not a "
                    f"mapping or a list (set the whole value: {path}=...)"
                )
                return None
            target = child
        return target, path


def apply_overrides(
    data: dict[str, Any], locations: Locations, overrides: Sequence[str]
) -> list[ConfigIssue]:
    """Set each ``a.b.c=VALUE`` in ``data`` (VALUE read as YAML) and return the bad ones.

    Intermediate mappings are created as needed. A number indexes a list (``a.rewards.0.fn=x``,
    or ``a.rewards[0].fn=x`` as error messages write key paths); ``a.rewards+=VALUE`` appends
    VALUE to the list (``a.rewards.+=`` and ``a.rewards[+]=`` are the same; a key the file does
    not set starts as an empty list). The overridden key paths, and everything under them, then
    report at ``override 'a.b.c=VALUE'`` instead of a file line. ``~a.b.c`` removes the key (so
    its default applies, or so a stage switched to another plugin loses an option that plugin
    lacks), ``~a.rewards.1`` a list item; ``a.b.c=null`` sets null.
    """
    issues = []
    for text in overrides:
        where = f"override {text!r}"
        if text.startswith("~"):
            issues.extend(_remove(data, locations, text[1:].strip(), where))
            continue
        key, sep, value_text = text.partition("=")
        key = key.strip()
        if not sep:
            issues.append(
                ConfigIssue(
                    "",
                    "an override must look like KEY=VALUE (e.g. stages.learner.replicas=2), "
                    "or KEY+=VALUE to append to a list",
                    where,
                )
            )
            continue
        append = next((s for s in _APPEND_SUFFIXES if key.endswith(s)), "")
        if append:
            key = key[: -len(append)].rstrip()
        parts = _key_parts(key)
        if parts is None:
            issues.append(
                ConfigIssue(
                    key,
                    "the key of an override must be a dotted path with no "
                    "empty parts (e.g. stages.learner.replicas, stages.scorer.rewards.0.fn)",
                    where,
                )
            )
            continue
        value, value_issues = _override_value(text, value_text)
        if value_issues:
            issues.extend(ConfigIssue(key, i.message, where) for i in value_issues)
            continue
        walk = _Walk(key, where, locations)
        if append:
            _append(data, parts, value, walk)
        else:
            _set(data, parts, value, walk)
        if walk.issue is not None:
            issues.append(walk.issue)
    return issues


def _set(data: dict[str, Any], parts: list[str], value: Any, walk: _Walk) -> None:
    found = walk.descend(data, parts[:-1], create=True)
    if found is None:
        return
    target, path = found
    last = parts[-1]
    if isinstance(target, list):
        i = walk.index(target, last, path)
        if i is None:
            return
        target[i], path = value, f"{path}[{i}]"
    else:
        target[last], path = value, join_path(path, last)
    walk.locations.drop_under(path)
    _mark_all(walk.locations, path, value, walk.where)


def _append(data: dict[str, Any], parts: list[str], value: Any, walk: _Walk) -> None:
    found = walk.descend(data, parts[:-1], create=True)
    if found is None:
        return
    parent, parent_path = found
    last = parts[-1]
    if isinstance(parent, list):
        i = walk.index(parent, last, parent_path)
        if i is None:
            return
        items, path = parent[i], f"{parent_path}[{i}]"
    else:
        path = join_path(parent_path, last)
        items = parent.get(last)
        if items is None:  # not in the file: a new list (its default, if any, is replaced)
            items = parent[last] = []
            walk.locations.drop_under(path)
            walk.locations.set(path, walk.where)
    if not isinstance(items, list):
        walk.fail(
            f"cannot append to {path!r}: it is {_describe(items)}, not a list "
            f"(set the whole value: {path}=...)"
        )
        return
    items.append(value)
    _mark_all(walk.locations, f"{path}[{len(items) - 1}]", value, walk.where)


def _remove(data: dict[str, Any], locations: Locations, key: str, where: str) -> list[ConfigIssue]:
    parts = _key_parts(key)
    if parts is None or "=" in key:
        return [
            ConfigIssue(
                key,
                "a removal must look like ~KEY, with a dotted path and no "
                "value (e.g. ~stages.learner.lr, ~stages.scorer.rewards.1)",
                where,
            )
        ]
    walk = _Walk(key, where, locations)
    found = walk.descend(data, parts[:-1], create=False)
    if found is not None:
        target, path = found
        last = parts[-1]
        if isinstance(target, list):
            i = walk.index(target, last, path)
            if i is not None:
                del target[i]
                locations.drop_under(f"{path}[{i}]")
                locations.renumber_after_removal(path, i)
        elif last in target:
            del target[last]
            locations.drop_under(join_path(path, last))
        else:
            walk.fail("nothing to remove: the config has no such key")
    elif walk.issue is not None and walk.issue.message.startswith("nothing there"):
        walk.fail("nothing to remove: the config has no such key")
    return [] if walk.issue is None else [walk.issue]


def _mark_all(locations: Locations, path: str, value: Any, where: str) -> None:
    locations.set(path, where)
    if isinstance(value, dict):
        for key, item in value.items():
            _mark_all(locations, join_path(path, str(key)), item, where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _mark_all(locations, f"{path}[{i}]", item, where)


def dump_yaml(data: Any) -> str:
    """``data`` (plain values) as block-style YAML that ``load_yaml`` reads back unchanged."""
    return yaml.dump(
        data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True
    )
