"""Reading the YAML files a user writes (a run's config, a sweep's space): each key of a mapping given once (YAML
parsers keep the last of two silently, so `lr` written twice would train with whichever came last), and a file that
does not parse is one line saying where, not PyYAML's block of marks and carets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tuneforge.errors import ConfigError


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping holding the same key twice (a merge `<<` may still be overridden)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (lines {seen[key]} and {line}); keep one", None
                    )
                seen[key] = line
        return super().construct_mapping(node, deep)


def one_line(err: yaml.YAMLError) -> str:
    """A YAML error as one line: what is wrong and where (line and column, counted from 1)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return ": ".join(str(part) for part in (err.context, err.problem) if part) + where
    return " ".join(str(err).split())


def read_yaml(path: str | Path, what: str) -> Any:
    """The data of the user's YAML file `path` (`what`: how messages name it, e.g. "config file"); a file that is
    not UTF-8 YAML with unique keys is one ConfigError line."""
    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {one_line(err)}") from None
    except UnicodeDecodeError as err:
        where = f"byte 0x{err.object[err.start]:02x} at offset {err.start}"
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text ({where}); re-save it as UTF-8") from None
