"""Small regex parsers for C headers, shared by the tests that compare headers with Python.

They read what the headers here and cuDNN's headers contain and nothing more: ``typedef enum
{...} name;`` blocks (explicit, implicit and alias values) and function declarations
(``ret name(params);``). Comments and preprocessor lines are removed first.
"""

import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INCLUDE = REPO / "include"

# Attribute macros cuDNN puts in declarations; they are not part of any type or name.
_MARKERS = re.compile(r"\b(?:CUDNN_DEPRECATED_ENUM|CUDNN_DEPRECATED|CUDNNWINAPI)\b")
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_DIRECTIVE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)
_ENUM = re.compile(r"typedef\s+enum\s*\w*\s*\{(?P<body>[^{}]*)\}\s*(?P<name>\w+)[\s\w]*;")
_FUNCTION = re.compile(r"(?P<returns>[\w\s*]*?)\b(?P<name>\w+)\s*\((?P<params>[^()]*)\)", re.S)
_PARAM = re.compile(r"(?P<type>.*?)\b(?P<name>\w+)\s*(?P<array>\[[^\]]*\])?", re.S)


@dataclass(frozen=True)
class Member:
    value: int | None  # None where the value is an expression this parser does not evaluate
    deprecated: bool


@dataclass(frozen=True)
class Param:
    type: str  # tokens joined by single spaces: "const void *"; an array parameter ends "*"
    name: str


@dataclass(frozen=True)
class Function:
    name: str
    returns: str
    params: tuple[Param, ...]


def strip(text: str) -> str:
    """``text`` without comments and preprocessor directives."""
    return _DIRECTIVE.sub("", _COMMENT.sub(" ", text))


def _type(text: str) -> str:
    return " ".join(re.findall(r"\w+|\*", text))


def parse_enums(text: str) -> dict[str, dict[str, Member]]:
    """Every ``typedef enum``: typedef name -> {member name -> Member}, in header order."""
    enums: dict[str, dict[str, Member]] = {}
    for match in _ENUM.finditer(strip(text)):
        members: dict[str, Member] = {}
        next_value: int | None = 0
        for item in filter(None, (i.strip() for i in match["body"].split(","))):
            deprecated = "CUDNN_DEPRECATED_ENUM" in item
            name, _, expr = (part.strip() for part in _MARKERS.sub("", item).partition("="))
            value = next_value if not expr else _evaluate(expr, members)
            members[name] = Member(value, deprecated)
            next_value = None if value is None else value + 1
        enums[match["name"]] = members
    return enums


def _evaluate(expr: str, members: dict[str, Member]) -> int | None:
    if expr in members:
        return members[expr].value
    try:
        return int(expr.rstrip("uUlL"), 0)
    except ValueError:
        return None


def parse_functions(text: str) -> dict[str, Function]:
    """Every function declaration: name -> Function."""
    functions = {}
    for statement in re.split(r"[;{}]", _MARKERS.sub(" ", strip(text))):
        match = _FUNCTION.fullmatch(statement.strip())
        if match is None or match["returns"].split()[:1] == ["typedef"]:
            continue
        functions[match["name"]] = Function(
            match["name"], _type(match["returns"]), _parse_params(match["params"])
        )
    return functions


def _parse_params(text: str) -> tuple[Param, ...]:
    if text.strip() in ("", "void"):
        return ()
    params = []
    for raw in text.split(","):
        match = _PARAM.fullmatch(raw.strip())
        assert match, f"cannot parse parameter {raw!r}"
        params.append(Param(_type(match["type"] + (" *" if match["array"] else "")), match["name"]))
    return tuple(params)


def infini_headers() -> list[Path]:
    """The headers of ``include/``."""
    return sorted(INCLUDE.rglob("*.h"))


@functools.cache
def infini_enums() -> dict[str, dict[str, Member]]:
    return {k: v for h in infini_headers() for k, v in parse_enums(h.read_text()).items()}


@functools.cache
def infini_functions() -> dict[str, Function]:
    return {k: v for h in infini_headers() for k, v in parse_functions(h.read_text()).items()}


def cudnn_include_dir() -> Path | None:
    """The ``include`` folder of the installed ``nvidia-cudnn`` wheel, or None."""
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except ModuleNotFoundError:
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "include" / "cudnn_graph.h").is_file():
            return Path(location) / "include"
    return None


CUDNN_HEADERS = ("cudnn_graph.h", "cudnn_ops.h")


def _cudnn_texts() -> list[str]:
    import pytest

    include = cudnn_include_dir()
    if include is None:
        pytest.skip("the nvidia-cudnn wheel's headers are not installed")
    return [(include / name).read_text() for name in CUDNN_HEADERS]


@functools.cache
def cudnn_enums() -> dict[str, dict[str, Member]]:
    """Enums of the wheel's ``cudnn_graph.h`` and ``cudnn_ops.h``; skips the test if absent."""
    return {k: v for text in _cudnn_texts() for k, v in parse_enums(text).items()}


@functools.cache
def cudnn_functions() -> dict[str, Function]:
    """Functions of the wheel's ``cudnn_graph.h`` and ``cudnn_ops.h``; skips if absent."""
    return {k: v for text in _cudnn_texts() for k, v in parse_functions(text).items()}
