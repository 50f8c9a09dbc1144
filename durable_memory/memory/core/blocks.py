"""Block values: validation against a schema, the char limit, and the value rendering.

A block's *value* (what the model sees inside `<value>`, what the char limit counts) is:
- text blocks: the text itself;
- the persona and human kinds of the seed 000_d8598551964ab573.txt: its one-line-per-tag
  serialization;
- other typed blocks: one `[FIELD] value` line per non-empty field, lists joined by '; '.
"""

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, replace

from durable_memory.memory.core.errors import BlockValidationError, CharLimitExceeded
from durable_memory.models.blocks import (
    BlockFields,
    BlockKind,
    BlockSpec,
    FieldSpec,
    FieldType,
    FieldValue,
    SessionState,
)

DEFAULT_CORE_LIMIT = 1500
"""CORE_MEMORY_MAX_CHARS of the seed 000_d8598551964ab573.txt."""

HUMAN_CONTEXT_WINDOW = 10
"""Context notes kept in a human block (a rolling window)."""
HUMAN_CONTEXT_RENDERED = 3
"""Context notes shown in the rendering: the last ones of the window."""

TEXT_FIELD = FieldSpec(name="value", type=FieldType.TEXT)


def text_fields() -> tuple[FieldSpec, ...]:
    return (TEXT_FIELD,)


def persona_fields() -> tuple[FieldSpec, ...]:
    """PersonaBlock fields of the seed 000_d8598551964ab573.txt, defaults and limits."""
    return (
        FieldSpec(name="name", type=FieldType.STR, default="Assistant", required=True),
        FieldSpec(name="role", type=FieldType.STR, required=True),
        FieldSpec(name="capabilities", type=FieldType.LIST, max_items=5),
        FieldSpec(name="tone", type=FieldType.STR, default="professional", required=True),
        FieldSpec(name="verbosity", type=FieldType.STR, default="concise", required=True),
        FieldSpec(name="constraints", type=FieldType.LIST, max_items=3),
        FieldSpec(name="expertise", type=FieldType.LIST, max_items=4),
    )


def human_fields() -> tuple[FieldSpec, ...]:
    """HumanBlock fields of the seed 000_d8598551964ab573.txt, defaults and limits."""
    return (
        FieldSpec(name="name", type=FieldType.STR),
        FieldSpec(name="role", type=FieldType.STR),
        FieldSpec(name="current_task", type=FieldType.STR),
        FieldSpec(
            name="session_state",
            type=FieldType.ENUM,
            choices=tuple(s.value for s in SessionState),
            default=SessionState.IDLE.value,
            required=True,
        ),
        FieldSpec(name="preferences", type=FieldType.LIST, max_items=4),
        FieldSpec(name="context_notes", type=FieldType.LIST, max_items=HUMAN_CONTEXT_WINDOW),
        FieldSpec(name="facts", type=FieldType.LIST, max_items=3),
    )


BUILTIN_FIELDS = {
    BlockKind.TEXT: text_fields,
    BlockKind.PERSONA: persona_fields,
    BlockKind.HUMAN: human_fields,
}


def _check_text(spec: BlockSpec, field: str, text: str) -> None:
    for ch in text:
        if ch in "\n\t":
            continue
        category = unicodedata.category(ch)
        if category in ("Cc", "Cs"):
            raise BlockValidationError(
                f"block '{spec.label}': field '{field}' contains the control character "
                f"U+{ord(ch):04X}; only newlines and tabs are allowed",
                field,
            )


def _validate_value(spec: BlockSpec, field: FieldSpec, raw: object) -> FieldValue:
    try:
        return _checked_value(spec, field, raw)
    except BlockValidationError as error:
        error.field = field.name
        raise


def _checked_value(spec: BlockSpec, field: FieldSpec, raw: object) -> FieldValue:
    where = f"block '{spec.label}': field '{field.name}'"
    if field.type is FieldType.LIST:
        if raw is None:
            items: list[str] = []
        elif isinstance(raw, list) and all(isinstance(i, str) for i in raw):
            items = [i.strip() for i in raw]
        else:
            raise BlockValidationError(f"{where} must be a list of strings, got {raw!r:.80}")
        for item in items:
            _check_text(spec, field.name, item)
            if not item:
                raise BlockValidationError(f"{where} has an empty item")
            if "\n" in item:
                raise BlockValidationError(
                    f"{where}: list items are one line each, got {item!r:.80}"
                )
        if field.max_items is not None and len(items) > field.max_items:
            raise BlockValidationError(
                f"{where} has {len(items)} items, more than its maximum of {field.max_items}"
            )
        return items
    if raw is None:
        text = ""
    elif isinstance(raw, str):
        text = raw.strip()
    else:
        raise BlockValidationError(f"{where} must be a string, got {type(raw).__name__}")
    _check_text(spec, field.name, text)
    if field.type is FieldType.TEXT:
        return text
    if not text:
        if field.required:
            raise BlockValidationError(f"{where} is required")
        return None
    if field.type is FieldType.ENUM:
        assert field.choices is not None
        if text not in field.choices:
            raise BlockValidationError(
                f"{where} must be one of {', '.join(field.choices)}; got {text!r:.80}"
            )
    return text


def validate_fields(
    spec: BlockSpec, raw: Mapping[str, object], *, enforce_limit: bool = True
) -> BlockFields:
    """Normalise and check a block's fields against its schema and char limit.

    Strings are stripped, empty optional strings become None, missing lists become []. The
    result is what the block stores; validating it again returns it unchanged. Reads pass
    `enforce_limit=False`: a block over a limit lowered since it was written stays readable
    (and rotation brings it back under); every write enforces the limit.
    """
    names = {f.name for f in spec.fields}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise BlockValidationError(
            f"block '{spec.label}' has no field {', '.join(repr(u) for u in unknown)}; "
            f"its fields are {', '.join(sorted(names))}"
        )
    fields = {f.name: _validate_value(spec, f, raw.get(f.name)) for f in spec.fields}
    size = len(render_value(spec, fields))
    if enforce_limit and size > spec.limit:
        raise CharLimitExceeded(spec.label, size, spec.limit)
    return fields


def default_fields(spec: BlockSpec) -> BlockFields:
    """The block's initial content: the profile's `default` over the field defaults."""
    raw: dict[str, object] = {f.name: f.default for f in spec.fields}
    raw.update(spec.default)
    return validate_fields(spec, raw)


def _items(fields: BlockFields, name: str) -> list[str]:
    value = fields.get(name)
    return value if isinstance(value, list) else []


def _text(fields: BlockFields, name: str) -> str:
    value = fields.get(name)
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class ValueLine:
    """One line of a typed block's rendering and the fields it shows."""

    text: str
    fields: tuple[str, ...]


def persona_lines(fields: BlockFields) -> list[ValueLine]:
    """PersonaBlock.to_memory_string() of the seed 000_d8598551964ab573.txt, line by line."""
    lines = [
        ValueLine(f"[IDENTITY] {_text(fields, 'name')} | {_text(fields, 'role')}", ("name", "role"))
    ]
    if capabilities := _items(fields, "capabilities"):
        lines.append(ValueLine(f"[CAPABILITIES] {', '.join(capabilities)}", ("capabilities",)))
    if expertise := _items(fields, "expertise"):
        lines.append(ValueLine(f"[EXPERTISE] {', '.join(expertise)}", ("expertise",)))
    lines.append(
        ValueLine(
            f"[STYLE] {_text(fields, 'tone')}, {_text(fields, 'verbosity')}", ("tone", "verbosity")
        )
    )
    if constraints := _items(fields, "constraints"):
        lines.append(ValueLine(f"[CONSTRAINTS] {'; '.join(constraints)}", ("constraints",)))
    return lines


def human_lines(fields: BlockFields) -> list[ValueLine]:
    """HumanBlock.to_memory_string() of the seed 000_d8598551964ab573.txt, line by line."""
    lines = []
    who = " | ".join(p for p in (_text(fields, "name"), _text(fields, "role")) if p)
    if who:
        lines.append(ValueLine(f"[USER] {who}", ("name", "role")))
    if task := _text(fields, "current_task"):
        lines.append(ValueLine(f"[TASK] {task}", ("current_task",)))
    lines.append(ValueLine(f"[STATE] {_text(fields, 'session_state')}", ("session_state",)))
    if preferences := _items(fields, "preferences"):
        lines.append(ValueLine(f"[PREFS] {'; '.join(preferences)}", ("preferences",)))
    if facts := _items(fields, "facts"):
        lines.append(ValueLine(f"[FACTS] {'; '.join(facts)}", ("facts",)))
    if notes := _items(fields, "context_notes")[-HUMAN_CONTEXT_RENDERED:]:
        lines.append(ValueLine(f"[CONTEXT] {'; '.join(notes)}", ("context_notes",)))
    return lines


def typed_lines(spec: BlockSpec, fields: BlockFields) -> list[ValueLine]:
    lines = []
    for field in spec.fields:
        value = fields.get(field.name)
        tag = field.name.upper()
        if isinstance(value, list) and value:
            lines.append(ValueLine(f"[{tag}] {'; '.join(value)}", (field.name,)))
        elif isinstance(value, str) and value:
            lines.append(ValueLine(f"[{tag}] {value}", (field.name,)))
    return lines


CONTINUATION = "\n    "
"""How a line break inside a field's value is rendered: the next line is indented, so no
value can start a line of its own that reads as another field (`Outline\n[FACTS] ...`)."""


def value_lines(spec: BlockSpec, fields: BlockFields) -> list[ValueLine]:
    """The rendering of a typed block, one ValueLine per field line (text blocks: not
    line-typed); a value's own line breaks continue its line, indented."""
    if spec.kind is BlockKind.PERSONA:
        lines = persona_lines(fields)
    elif spec.kind is BlockKind.HUMAN:
        lines = human_lines(fields)
    else:
        lines = typed_lines(spec, fields)
    return [replace(line, text=line.text.replace("\n", CONTINUATION)) for line in lines]


def render_value(spec: BlockSpec, fields: BlockFields) -> str:
    """What the model sees as the block's value; the char limit counts its characters."""
    if spec.kind is BlockKind.TEXT:
        return _text(fields, "value")
    return "\n".join(line.text for line in value_lines(spec, fields))
