"""Applying edit operations to block values, and deciding whether a stale proposal still applies.

Every function here is pure: fields in, fields out. Errors are OperationNotApplicable (the
operation does not fit the block) or BlockValidationError (the result breaks the schema or the
char limit), with messages a model or a person can act on.
"""

from datetime import datetime

from durable_memory.memory.core.blocks import (
    HUMAN_CONTEXT_WINDOW,
    validate_fields,
)
from durable_memory.memory.core.errors import OperationNotApplicable
from durable_memory.memory.core.limits import cut_at_word
from durable_memory.models.blocks import BlockFields, BlockKind, BlockSpec, FieldType, SessionState
from durable_memory.models.operations import (
    AddContext,
    AddItem,
    AppendText,
    ClearTask,
    EditOperation,
    InsertText,
    LearnFact,
    LearnPreference,
    RemoveItem,
    ReplaceFields,
    ReplaceText,
    RethinkText,
    SetField,
    SetTask,
)

_TEXT_OPS = (AppendText, ReplaceText, InsertText, RethinkText)
_HUMAN_OPS = (SetTask, ClearTask, LearnPreference, LearnFact, AddContext)


def _require_kind(spec: BlockSpec, op: EditOperation) -> None:
    if isinstance(op, _TEXT_OPS) and spec.kind is not BlockKind.TEXT:
        raise OperationNotApplicable(
            f"block '{spec.label}' has typed fields ({', '.join(f.name for f in spec.fields)}); "
            f"'{op.op}' works on text blocks: use set_field, add_item or remove_item instead"
        )
    if not isinstance(op, _TEXT_OPS) and spec.kind is BlockKind.TEXT:
        raise OperationNotApplicable(
            f"block '{spec.label}' is free text; '{op.op}' works on typed blocks: use append, "
            "replace, insert or rethink instead"
        )
    if isinstance(op, _HUMAN_OPS) and spec.kind is not BlockKind.HUMAN:
        raise OperationNotApplicable(f"'{op.op}' works on a human block; '{spec.label}' is not one")


def _list_field(spec: BlockSpec, fields: BlockFields, name: str) -> list[str]:
    field = spec.field(name)
    if field is None:
        raise OperationNotApplicable(
            f"block '{spec.label}' has no field '{name}'; its fields are "
            f"{', '.join(f.name for f in spec.fields)}"
        )
    if field.type is not FieldType.LIST:
        raise OperationNotApplicable(
            f"field '{name}' of block '{spec.label}' is {field.type.value}, not a list; "
            "use set_field"
        )
    value = fields.get(name)
    return list(value) if isinstance(value, list) else []


def _rolling(items: list[str], item: str, limit: int | None) -> list[str]:
    """Add `item` unless present; beyond `limit`, the oldest items leave (git keeps them)."""
    if item in items:
        return items
    items = [*items, item]
    return items[-limit:] if limit is not None else items


def line_numbers(text: str, needle: str) -> list[int]:
    """1-based line numbers where each occurrence of `needle` starts."""
    numbers, start = [], text.find(needle)
    while start != -1:
        numbers.append(text.count("\n", 0, start) + 1)
        start = text.find(needle, start + 1)
    return numbers


def _apply_text(value: str, op: EditOperation, label: str) -> str:
    match op:
        case AppendText(content=content):
            return f"{value}\n{content}" if value else content
        case ReplaceText(old_content=old, new_content=new):
            where = line_numbers(value, old)
            if not where:
                raise OperationNotApplicable(
                    f"old_content not found in block '{label}'; copy it exactly from the block"
                )
            if len(where) > 1:
                raise OperationNotApplicable(
                    f"old_content appears {len(where)} times in block '{label}' (lines "
                    f"{', '.join(map(str, where))}); include more surrounding text so it is unique"
                )
            return value.replace(old, new, 1)
        case InsertText(new_string=new, insert_line=line):
            lines = value.split("\n") if value else []
            at = len(lines) if line == -1 else line
            if at > len(lines):
                raise OperationNotApplicable(
                    f"insert_line {line} is past the end of block '{label}' ({len(lines)} lines); "
                    "use 0 for the top or -1 for the end"
                )
            return "\n".join([*lines[:at], *new.split("\n"), *lines[at:]])
        case RethinkText(new_value=new):
            return new
    raise AssertionError(op)


def _apply_typed(spec: BlockSpec, fields: BlockFields, op: EditOperation) -> BlockFields:
    new = dict(fields)
    match op:
        case ReplaceFields(fields=replacement):
            return dict(replacement)
        case SetField(field=name, value=value):
            if spec.field(name) is None:
                raise OperationNotApplicable(
                    f"block '{spec.label}' has no field '{name}'; its fields are "
                    f"{', '.join(f.name for f in spec.fields)}"
                )
            new[name] = value
        case AddItem(field=name, value=value):
            items = _list_field(spec, fields, name)
            if value.strip() in items:
                raise OperationNotApplicable(f"'{value}' is already in {spec.label}.{name}")
            new[name] = [*items, value]
        case RemoveItem(field=name, value=value):
            items = _list_field(spec, fields, name)
            if value.strip() not in items:
                raise OperationNotApplicable(
                    f"'{value}' is not in {spec.label}.{name}; its items are: "
                    f"{'; '.join(items) or '(none)'}"
                )
            items.remove(value.strip())
            new[name] = items
        case SetTask(task=task, context=context):
            new["current_task"] = task
            new["session_state"] = SessionState.ACTIVE_TASK.value
            if context:
                notes = _list_field(spec, fields, "context_notes")
                new["context_notes"] = _rolling(notes, context, HUMAN_CONTEXT_WINDOW)
        case ClearTask():
            new["current_task"] = None
            new["session_state"] = SessionState.IDLE.value
        case LearnPreference(preference=item) | LearnFact(fact=item) | AddContext(note=item):
            name = {"learn_preference": "preferences", "learn_fact": "facts"}.get(
                op.op, "context_notes"
            )
            field = spec.field(name)
            limit = field.max_items if field else None
            new[name] = _rolling(_list_field(spec, fields, name), item.strip(), limit)
        case _:
            raise AssertionError(op)
    return new


def apply_operation(spec: BlockSpec, fields: BlockFields, op: EditOperation) -> BlockFields:
    """The block's fields after `op`, validated against the schema and the char limit."""
    _require_kind(spec, op)
    if spec.kind is BlockKind.TEXT:
        value = fields.get("value")
        raw: BlockFields = {
            "value": _apply_text(value if isinstance(value, str) else "", op, spec.label)
        }
    else:
        raw = _apply_typed(spec, fields, op)
    return validate_fields(spec, raw)


def _touched(op: EditOperation) -> tuple[str, ...] | None:
    """Fields whose change since the base makes `op` stale; None when only re-applying tells."""
    match op:
        case RethinkText() | ReplaceFields():
            return ("*",)
        case SetField(field=name):
            return (name,)
        case SetTask() | ClearTask():
            return ("current_task", "session_state")
    return None


def conflict_reason(
    spec: BlockSpec, base: BlockFields, head: BlockFields, op: EditOperation
) -> str | None:
    """Why `op`, proposed against `base`, must not be applied to `head` (None: it may).

    Appends and list additions commute with other edits; a replace still applies while its
    text is there exactly once; an insert while the lines above it are unchanged; whole-value
    rewrites and field sets only while what they overwrite is unchanged.
    """
    if base == head:
        return None
    if isinstance(op, InsertText):
        before = (str(base.get("value") or "")).split("\n")
        after = (str(head.get("value") or "")).split("\n")
        at = len(before) if op.insert_line == -1 else op.insert_line
        if op.insert_line == -1 or before[:at] != after[:at]:
            return f"the lines of block '{spec.label}' above line {op.insert_line} changed"
        return None
    touched = _touched(op)
    if touched == ("*",):
        return f"block '{spec.label}' changed since the proposal; rewriting it would lose that"
    for name in touched or ():
        if base.get(name) != head.get(name):
            return f"field '{name}' of block '{spec.label}' changed since the proposal"
    return None


def rewrite_operation(spec: BlockSpec, fields: BlockFields) -> EditOperation:
    """The operation that rewrites the whole block to `fields` (validated): what an edited
    Markdown form of the block proposes (a reviewer's edit, Claude's memory tool)."""
    if spec.kind is BlockKind.TEXT:
        return RethinkText(new_value=str(fields["value"]))
    return ReplaceFields(fields=fields)


def describe(op: EditOperation, label: str) -> str:
    """A one-line summary for commit messages, diff lists and the Temporal UI: quoted values
    are cut at word boundaries (`cut_at_word`), never mid-word."""
    match op:
        case AppendText(content=c):
            return f"Append to {label}: {cut_at_word(c, 60)}"
        case ReplaceText(old_content=old, new_content=new):
            return f"Replace in {label}: {cut_at_word(old, 30)!r} -> {cut_at_word(new, 30)!r}"
        case InsertText(insert_line=line):
            return f"Insert into {label} at line {line}"
        case RethinkText() | ReplaceFields():
            return f"Rewrite {label}"
        case SetField(field=name, value=value):
            return f"Set {label}.{name} = {cut_at_word(str(value), 60)}"
        case AddItem(field=name, value=value):
            return f"Add to {label}.{name}: {cut_at_word(value, 60)}"
        case RemoveItem(field=name, value=value):
            return f"Remove from {label}.{name}: {cut_at_word(value, 60)}"
        case SetTask(task=task):
            return f"Set task in {label}: {cut_at_word(task, 60)}"
        case ClearTask(archive=archive):
            return f"Clear task in {label}" + (" (archived)" if archive else "")
        case LearnPreference(preference=p):
            return f"Learn preference in {label}: {cut_at_word(p, 60)}"
        case LearnFact(fact=f):
            return f"Learn fact in {label}: {cut_at_word(f, 60)}"
        case AddContext(note=n):
            return f"Add context to {label}: {cut_at_word(n, 60)}"
    raise AssertionError(op)


def format_task_archive(fields: BlockFields, when: datetime) -> str:
    """The task archival text of the seed 000_d8598551964ab573.txt: `[TASK COMPLETED <iso>]`,
    `Task:` and `Context:` lines."""
    task = fields.get("current_task") or ""
    notes = fields.get("context_notes") or []
    lines = [f"[TASK COMPLETED {when.strftime('%Y-%m-%dT%H:%M:%S')}]", f"Task: {task}", "Context:"]
    lines.extend(f"- {note}" for note in notes)
    return "\n".join(lines)
