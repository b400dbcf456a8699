"""Strict, bounded YAML reading for sweep specs and run configs: a size, a node and a depth budget on every file
(docs/spec.md). An alias counts the whole size of what it names ("billion laughs": a file under a kilobyte can
describe billions of values), and a document past the budget is refused while composing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode
from yaml.reader import Reader

from qed_ray.spec.hints import short_repr

MAX_BYTES = 1 << 20  # a spec is a few kilobytes (the paper's dmc18.yaml: 2 KB)
MAX_NODES = 100_000  # values once aliases are expanded; a 10,000-seed list and every setting fit many times over
MAX_DEPTH = 32  # nesting levels; the deepest spec setting (agents[i].overrides.mad.<field>: [axis]) is 7
MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlInputError(ValueError):
    """A YAML file that cannot be read, is too large, or is not strict YAML; the message is one line."""


class _Refused(Exception):
    """A budget or shape refusal raised while composing (carries the message without the file name)."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats, duplicate keys and complex keys as errors, and the node and depth budgets.
    An alias's target is complete before it can be named (one still being composed is a recursive alias), so its
    expanded size and height are known: ``_cost`` holds them per anchored node."""

    def __init__(self, stream: str, max_nodes: int, max_depth: int):
        super().__init__(stream)
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.nodes, self._level, self._deepest = 0, 0, 0
        self._cost: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent, index):
        event = self.peek_event()
        is_key = isinstance(parent, MappingNode) and index is None
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:
                self._alias(event, target, is_key)
            return super().compose_node(parent, index)  # an undefined alias: PyYAML's own error
        self._level += 1
        self._count(1, event)
        start, outer = self.nodes, max(self._deepest, self._level)
        self._deepest = self._level
        try:
            node = super().compose_node(parent, index)
        finally:
            self._level -= 1
        if event.anchor is not None:
            self._cost[id(node)] = (self.nodes - start + 1, self._deepest - self._level)
        self._deepest = max(outer, self._deepest)
        if isinstance(node, MappingNode):
            self._check_keys(node)
        if is_key and not isinstance(node, ScalarNode):
            raise _Refused(f"line {event.start_mark.line + 1}: a mapping key must be a plain value, not a "
                           f"{_kind(node)} (complex keys are not allowed)")
        return node

    def _check_keys(self, node: MappingNode) -> None:
        """Refuses a key given twice in one mapping, before merges are applied: a key that a merge (``<<``) brings
        in may be given again explicitly."""
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {short_repr(key)} (the last one "
                                                                   f"would win silently)", key_node.start_mark)
            seen.add(key)

    def _alias(self, event, target, is_key: bool) -> None:
        cost = self._cost.get(id(target))
        if cost is None:
            raise _Refused(f"line {event.start_mark.line + 1}: alias *{event.anchor} names a node that contains it "
                           f"(a recursive structure)")
        size, height = cost
        self._count(size, event)
        self._reach(self._level + height, event)
        if is_key and not isinstance(target, ScalarNode):
            raise _Refused(f"line {event.start_mark.line + 1}: a mapping key must be a plain value, not a "
                           f"{_kind(target)} (complex keys are not allowed; *{event.anchor} names one)")

    def _count(self, n: int, event) -> None:
        self.nodes += n
        if self.nodes > self.max_nodes:
            raise _Refused(f"line {event.start_mark.line + 1}: {self.nodes:,} values by this line, counting each "
                           f"alias (*name) as a copy of what it names; at most {self.max_nodes:,}")
        self._reach(self._level, event)

    def _reach(self, level: int, event) -> None:
        self._deepest = max(self._deepest, level)
        if level > self.max_depth:
            raise _Refused(f"line {event.start_mark.line + 1}: nested {level} levels deep (aliases expanded); at "
                           f"most {self.max_depth}")


def _kind(node) -> str:
    return "mapping" if isinstance(node, MappingNode) else "sequence" if isinstance(node, SequenceNode) else "value"


_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"), list("-+0123456789."))


def _mapping(loader: yaml.SafeLoader, node: MappingNode) -> dict:
    """A mapping with merge keys applied as YAML's merge type says: explicit keys win over merged ones, and an
    earlier mapping of a merge list over a later one. (PyYAML's own flattening keeps the first copy of a key
    once a merged mapping has itself merged and overridden one, so a nested override would be lost.)"""
    out: dict = {}
    explicit = []
    for key_node, value_node in node.value:
        if key_node.tag != MERGE_TAG:
            explicit.append((key_node, value_node))
            continue
        sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
        for source in reversed(sources):
            if not isinstance(source, MappingNode):
                raise yaml.constructor.ConstructorError(None, None, f"<< merges mappings, but found a "
                                                        f"{_kind(source)}", source.start_mark)
            out.update(loader.construct_object(source, deep=True))  # built once per node: aliases stay shared
    for key_node, value_node in explicit:
        out[loader.construct_object(key_node)] = loader.construct_object(value_node)
    return out


_BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read_text(path: Path, max_bytes: int = MAX_BYTES) -> str:
    """The file's UTF-8 text; refuses an unreadable, non-UTF-8 or oversized file before any parsing (the size again
    while reading: a pipe or a growing file has none)."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise YamlInputError(f"{path}: {size:,} bytes, more than the {max_bytes:,} a spec or config file may "
                                 f"have (is it the right file?)")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise YamlInputError(f"{path}: cannot be read ({e.strerror})") from None
    if len(data) > max_bytes:
        raise YamlInputError(f"{path}: more than the {max_bytes:,} bytes a spec or config file may have (is it "
                             f"the right file?)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YamlInputError(f"{path}: is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") \
            from None


def _refuse_unprintable(text: str, source: str | Path) -> None:
    """A NUL or other character YAML does not allow (its reader's own set), named with its line and column; PyYAML
    would raise it while the loader is still being built."""
    bad = Reader.NON_PRINTABLE.search(text)
    if bad:
        line, column = text.count("\n", 0, bad.start()) + 1, bad.start() - text.rfind("\n", 0, bad.start())
        raise YamlInputError(f"{source}: line {line}, column {column}: the character U+{ord(bad.group()):04X} is "
                             f"not allowed in YAML (a NUL or control character: is it the right file?)")


def parse(text: str, source: str | Path, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> Any:
    """Parses YAML strictly within the node and depth budgets; raises YamlInputError with one line."""
    _refuse_unprintable(text, source)
    loader = None
    try:
        loader = _BoundedLoader(text, max_nodes, max_depth)
        return loader.get_single_data()
    except _Refused as e:
        raise YamlInputError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise YamlInputError(f"{source}: invalid YAML ({' '.join(str(e).split())[:400]})") from None
    except (ValueError, OverflowError) as e:  # a scalar its type cannot hold (a 5,000-digit int, month 13)
        raise YamlInputError(f"{source}: invalid YAML value ({' '.join(str(e).split())[:200]})") from None
    finally:
        if loader is not None:
            loader.dispose()


def load(path: str | Path, max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES,
         max_depth: int = MAX_DEPTH) -> Any:
    path = Path(path)
    return parse(read_text(path, max_bytes), path, max_nodes, max_depth)
