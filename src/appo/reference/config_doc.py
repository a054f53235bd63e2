"""The config reference: one entry per key of `AppoConfig`, built from the code alone.

- type and default: the dataclass fields (`appo.config_schema`, `config_schema_update`);
- meaning: the comment block right above the field, or its trailing comment, read from the
  schema's source (so the reference and the code's comments cannot drift apart); a
  section's docstring introduces the section;
- allowed values: `CHOICES` / `LIST_CHOICES` and the range table (`appo.config_ranges`);
- verl name: appo's name with verl's `actor_rollout_ref.` prefix put back where verl has it,
  and the renamed keys of `appo.config_verl`.

`render_markdown()` is docs/reference/config.md; `explain(key)` is `appo config explain`.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import io
import json
import re
import textwrap
import tokenize
from dataclasses import asdict, dataclass, fields, is_dataclass
from functools import cache
from typing import Any

from appo import config_schema, config_schema_update, config_verl
from appo.config_ranges import range_for
from appo.config_schema import CHOICES, LIST_CHOICES, AppoConfig
from appo.errors import AppoError

# The entry of a mapping whose keys the user picks (a tool's name): `tools.tool_instances.<name>`.
ANY_NAME = "<name>"

# verl's section of each appo section (appo drops `actor_rollout_ref.`; its `tools` are
# verl's `actor_rollout_ref.rollout.tools`); sections not listed are appo's own.
VERL_SECTIONS: dict[str, str] = {
    "model": "actor_rollout_ref.model",
    "rollout": "actor_rollout_ref.rollout",
    "actor": "actor_rollout_ref.actor",
    "tools": "actor_rollout_ref.rollout.tools",
    "data": "data",
    "algorithm": "algorithm",
    "critic": "critic",
    "trainer": "trainer",
    "custom_reward_function": "custom_reward_function",
}


@dataclass(frozen=True)
class KeyDoc:
    """One config key as the reference shows it."""

    key: str
    type: str
    default: str
    allowed: str
    verl: str
    meaning: str


@dataclass(frozen=True)
class SectionDoc:
    name: str
    intro: str
    keys: tuple[KeyDoc, ...]


# The modules that hold the schema's dataclasses.
SCHEMA_MODULES = (config_schema, config_schema_update)


@cache
def schema_comments() -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """(class name, field name) -> the field's comment text, and class name -> docstring."""
    comments: dict[tuple[str, str], str] = {}
    docs: dict[str, str] = {}
    for module in SCHEMA_MODULES:
        more, more_docs = _module_comments(inspect.getsource(module))
        comments.update(more)
        docs.update(more_docs)
    return comments, docs


def _module_comments(source: str) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].strip() != tok.string:
            trailing[tok.start[0]] = tok.string
    comments: dict[tuple[str, str], str] = {}
    docs: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = " ".join((ast.get_docstring(node) or "").split())
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            block: list[str] = []
            row = stmt.lineno - 2  # the line above, 0-based
            while row >= 0 and lines[row].strip().startswith("#"):
                block.insert(0, lines[row].strip())
                row -= 1
            if stmt.lineno in trailing:
                block.append(trailing[stmt.lineno])
            text = " ".join(line.lstrip("#").strip() for line in block)
            comments[(node.name, stmt.target.id)] = text.strip()
    return comments, docs


def _format_default(value: Any) -> str:
    if value == "???":
        return "(required)"
    if is_dataclass(value):
        value = asdict(value)
    if isinstance(value, dict):
        value = {k: asdict(v) if is_dataclass(v) else v for k, v in value.items()}
    if isinstance(value, str) and value and value.strip() == value and "\n" not in value:
        return value
    return json.dumps(value)


def _allowed(key: str, type_: str) -> str:
    pattern = key.replace(f".{ANY_NAME}", ".*")
    if key in CHOICES:
        return "one of: " + ", ".join(CHOICES[key])
    if key in LIST_CHOICES:
        return "a list of: " + ", ".join(LIST_CHOICES[key])
    rng = range_for(pattern)
    items = range_for(pattern + ".x") if type_.startswith(("list", "dict")) else None
    if rng is not None:
        text = rng.describe()
    elif items is not None:
        text = "each entry " + items.describe()
    elif type_.split(" | ")[0] in ("int", "float"):
        text = "a finite number"
    elif type_.startswith("bool"):
        text = "true or false"
    else:
        return ""
    return text + ("; null: see meaning" if "None" in type_ and "null" not in text else "")


def verl_name(key: str) -> str:
    """The name verl gives the setting (where it has one), by the prefix rule and the
    renamed keys of `appo.config_verl`; "" for appo's own sections (sft, eval)."""
    renamed = {appo: verl for verl, appo in config_verl.RENAMED.items()}
    key = renamed.get(key, key)
    section, _, rest = key.partition(".")
    if section not in VERL_SECTIONS:
        return ""
    return f"{VERL_SECTIONS[section]}.{rest}"


def _walk(obj: Any, prefix: str, comments: dict[tuple[str, str], str]) -> list[KeyDoc]:
    out: list[KeyDoc] = []
    cls = type(obj).__name__
    for f in fields(obj):
        key = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        type_ = str(f.type)
        if is_dataclass(value):  # a nested group: its keys, with its docstring as meaning
            out.extend(_walk(value, key + ".", comments))
            continue
        meaning = comments.get((cls, f.name), "")
        out.append(KeyDoc(key, type_, _format_default(value), _allowed(key, type_),
                          verl_name(key), meaning))
        inner = next(iter(value.values()), None) if isinstance(value, dict) else None
        if is_dataclass(inner):  # a mapping of records: their keys under <name>, with the
            # record class's own defaults (not those of the default mapping's first entry)
            out.extend(_walk(type(inner)(), f"{key}.{ANY_NAME}.", comments))
    return out


@cache
def sections() -> tuple[SectionDoc, ...]:
    """Every section of `AppoConfig` and its keys, in the schema's order."""
    comments, docs = schema_comments()
    root = AppoConfig()
    out = []
    for f in fields(root):
        value = getattr(root, f.name)
        out.append(SectionDoc(f.name, docs.get(type(value).__name__, ""),
                              tuple(_walk(value, f.name + ".", comments))))
    return tuple(out)


def all_keys() -> dict[str, KeyDoc]:
    return {doc.key: doc for section in sections() for doc in section.keys}


def _md(text: str) -> str:
    """Text for a table cell: `|` escaped, and `<` too outside code spans, where Markdown
    would take `<result>` or `<dir>` for an HTML tag and hide it."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


HEADER = """\
# Config reference

Generated from the code by `appo reference --out docs/reference` (`appo.reference.config_doc`);
do not edit by hand: the meanings are the comments of `src/appo/config_schema.py` (and
`config_schema_update.py`), the
allowed values `CHOICES` there and the range table `src/appo/config_ranges.py`.
`tests/test_reference.py` fails when this file and the code differ. The same entry for one
key: `appo config explain KEY`. How a config is loaded (defaults, YAML, dotted overrides):
[configuration.md](../configuration.md).

**verl**: the name of the setting in verl, as the original ARPO/AEPO/APPO scripts pass it,
where verl has the setting: appo drops verl's `actor_rollout_ref.` prefix (verl's
`actor_rollout_ref.rollout.tools` are appo's `tools`), and a few keys are renamed
(`appo.config_verl`). appo reads verl's names as given, with the prefix refused with a line
naming appo's key. Keys that appo added (memory options, the engines, `sft`, `eval`) have
no verl counterpart even where the rule gives a name. `<name>` stands for any entry of a
mapping (a tool's name).
"""


def render_markdown() -> str:
    parts = [HEADER]
    for section in sections():
        parts.append(f"\n## `{section.name}`\n\n")
        if section.intro:
            parts.append(section.intro + "\n\n")
        parts.append("| key | type | default | allowed | verl | meaning |\n"
                     "| --- | --- | --- | --- | --- | --- |\n")
        for d in section.keys:
            verl = f"`{d.verl}`" if d.verl else "-"
            default = f"`{_md(d.default)}`" if d.default else ""
            parts.append(f"| `{d.key}` | `{_md(d.type)}` | {default} | {_md(d.allowed)} | "
                         f"{verl} | {_md(d.meaning)} |\n")
    parts.append(_verl_table())
    return "".join(parts)


def _verl_table() -> str:
    rows = [f"| `{k}` | `{v}` | renamed: the value moves there |"
            for k, v in config_verl.RENAMED.items()]
    rows += [f"| `{k}` | - | accepted (true or false), no effect: {_md(v)} |"
             for k, v in config_verl.NO_OPS.items()]
    rows += [f"| `{k}` | - | refused: {_md(v)} |" for k, v in config_verl.REFUSED.items()]
    return ("\n## verl keys appo reads differently\n\n"
            "Written without verl's `actor_rollout_ref.` prefix, as everywhere in appo.\n\n"
            "| verl key | appo key | what happens |\n| --- | --- | --- |\n"
            + "\n".join(rows) + "\n")


def entry_text(d: KeyDoc, width: int = 88) -> str:
    """One key as `appo config explain` prints it."""
    head = [f"{d.key}: {d.type} = {d.default}"]
    if d.allowed:
        head.append(f"  allowed: {d.allowed}")
    if d.verl:
        head.append(f"  verl: {d.verl}")
    body = textwrap.fill(d.meaning or "(no description)", width, initial_indent="  ",
                         subsequent_indent="  ")
    return "\n".join(head + [body]) + "\n"


def _verl_note(key: str) -> tuple[str, str] | None:
    """(note, appo key) for a name in verl's spelling; (note, "") where appo has no key."""
    v = config_verl
    if key in v.RENAMED:
        return f"{key} (verl's name) is appo's {v.RENAMED[key]}", v.RENAMED[key]
    if key in v.NO_OPS:
        return f"{key} (verl's) is accepted and has no effect: {v.NO_OPS[key]}", ""
    if key in v.REFUSED:
        return f"{key} is verl's, not appo's: {v.REFUSED[key]}", ""
    if key.startswith(v.PREFIX):
        appo_key = key.removeprefix(v.PREFIX).replace("rollout.tools.", "tools.", 1)
        inner = _verl_note(appo_key)
        if inner is not None:
            return inner
        return f"{key} (verl's name) is appo's {appo_key}", appo_key
    return None


def explain(key: str) -> str:
    """The entry of `key`, or of every key of a section or group (`actor`, `actor.optim`);
    an entry of a mapping (`eval.tool_call_limits.python`) gives the mapping's; verl's
    names say appo's. An unknown key is one `AppoError` line naming the nearest keys."""
    keys = all_keys()
    verl = _verl_note(key)
    if verl is not None:
        note, appo_key = verl
        if not appo_key:
            return note + "\n"
        try:
            return f"{note}\n\n{explain(appo_key)}"
        except AppoError as e:  # the verl name of a key appo lacks: name what was asked
            raise AppoError(f"{key} (verl's name, appo's {appo_key!r}): {e}") from None
    parts = key.split(".")
    for i in range(len(parts) - 1, 1, -1):
        head = ".".join(parts[:i])
        if head in keys and keys[head].type.startswith("dict") and not key.startswith(
                "tools.tool_instances."):
            return entry_text(keys[head])
    pattern = ".".join(ANY_NAME if i == 2 and key.startswith("tools.tool_instances.") else p
                       for i, p in enumerate(key.split(".")))
    if pattern in keys:
        return entry_text(keys[pattern])
    under = [d for k, d in keys.items() if k.startswith(key + ".")]
    if under:
        return "\n".join(entry_text(d) for d in under)
    near = difflib.get_close_matches(key, list(keys), n=3, cutoff=0.5)
    if not near:
        leaf = key.rsplit(".", 1)[-1]
        near = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:3]
    hint = f"; nearest: {', '.join(near)}" if near else ""
    raise AppoError(f"no config key {key!r}{hint}")


_KEY_LINE = re.compile(r"^( *)([A-Za-z0-9_@-]+):(?: .*)?$")


def annotate_yaml(text: str, width: int = 88) -> str:
    """A resolved config's YAML (`to_yaml`) with each key's meaning as a comment above it
    (`appo config show --comments`); the data is unchanged. A string that `to_yaml` folds
    over several lines continues one level deeper than its key, where no key is documented,
    so no comment lands inside it."""
    keys = all_keys()
    out: list[str] = []
    path: list[str] = []
    for line in text.splitlines():
        m = _KEY_LINE.match(line)
        if m is not None:
            depth = len(m.group(1)) // 2
            path[depth:] = [m.group(2)]
            key = ".".join(path)
            pattern = ".".join(ANY_NAME if i == 2 and key.startswith("tools.tool_instances.")
                               else p for i, p in enumerate(path))
            doc = keys.get(key) or keys.get(pattern)
            if doc is not None and doc.meaning:
                out += textwrap.wrap(doc.meaning, width, initial_indent=m.group(1) + "# ",
                                     subsequent_indent=m.group(1) + "# ")
        out.append(line)
    return "\n".join(out) + "\n"


__all__ = ["annotate_yaml", "KeyDoc", "SectionDoc", "all_keys", "explain", "render_markdown", "sections",
           "verl_name"]
