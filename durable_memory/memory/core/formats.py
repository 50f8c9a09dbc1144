"""Block formats: TOML for storage, Markdown for editing, Letta's XML-like form for the prompt.

Markdown shape (the seed 000_d8598551964ab573.txt's):

    ---
    block: student
    ---

    ## Name
    Alice

    ## Strengths
    - Creativity

Every field has a section, even when empty. In text sections a line that starts with '#' or
'\\' is written with a leading '\\' so that no value can forge a heading; that one backslash
is removed again on reading. List items are one line each.

Prompt shape: every text inside the prompt's sections is escaped with `escape_prompt_text`, so
that no value can close or open a section (see there).
"""

import html
import tomllib
from collections.abc import Mapping

import tomli_w

from durable_memory.memory.core.blocks import render_value, validate_fields
from durable_memory.memory.core.errors import BlockValidationError, FormatError
from durable_memory.models.blocks import BlockFields, BlockSpec, FieldSpec, FieldType


def to_toml(spec: BlockSpec, fields: BlockFields) -> str:
    """The stored form: one key per non-empty field, in schema order."""
    data: dict[str, str | list[str]] = {}
    for field in spec.fields:
        value = fields.get(field.name)
        if value is not None and (field.type is FieldType.TEXT or value != []):
            data[field.name] = value
    return tomli_w.dumps(data, multiline_strings=True)


def from_toml(
    spec: BlockSpec, text: str, source: str, *, enforce_limit: bool = True
) -> BlockFields:
    """Parse and validate a stored block; errors name `source` and, for syntax, the line."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise FormatError(f"{source}: not valid TOML: {error}") from None
    try:
        return validate_fields(spec, raw, enforce_limit=enforce_limit)
    except BlockValidationError as error:
        raise FormatError(f"{source}: {error}") from None


def _escape(line: str) -> str:
    return "\\" + line if line.startswith(("#", "\\")) else line


def _unescape(line: str) -> str:
    return line[1:] if line.startswith(("\\#", "\\\\")) else line


def to_markdown(spec: BlockSpec, fields: BlockFields) -> str:
    parts = [f"---\nblock: {spec.label}\n---\n"]
    for field in spec.fields:
        value = fields.get(field.name)
        if isinstance(value, list):
            body = "\n".join(f"- {item}" for item in value)
        else:
            body = "\n".join(_escape(line) for line in (value or "").split("\n"))
        parts.append(f"## {field.title}\n{body}\n" if body else f"## {field.title}\n")
    return "\n".join(parts)


def _field_for_heading(spec: BlockSpec, heading: str) -> FieldSpec | None:
    key = heading.strip().lower()
    return next(
        (f for f in spec.fields if key in (f.title.lower(), f.name)),
        None,
    )


def _parse_front_matter(spec: BlockSpec, lines: list[str]) -> int:
    """Check the front matter; return the index of the first line after it."""
    if not lines or lines[0].strip() != "---":
        raise FormatError("line 1: expected '---' opening the front matter")
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        raise FormatError("line 1: the front matter is not closed by a '---' line") from None
    block = None
    for number in range(1, end):
        key, sep, value = lines[number].partition(":")
        if not lines[number].strip():
            continue
        if not sep or key.strip() != "block":
            raise FormatError(
                f"line {number + 1}: unexpected front matter {lines[number]!r:.60}; "
                "only 'block: <label>' is allowed"
            )
        block = value.strip()
    if block != spec.label:
        raise FormatError(
            f"line 1: front matter says block {block!r}, expected 'block: {spec.label}'"
        )
    return end + 1


def _section_value(field: FieldSpec, body: list[tuple[int, str]]) -> object:
    if field.type is FieldType.LIST:
        items = []
        for number, line in body:
            if not line.strip():
                continue
            if not line.startswith("- ") or not line[2:].strip():
                raise FormatError(
                    f"line {number}: field '{field.name}' is a list; write each item as "
                    f"'- item', got {line!r:.60}"
                )
            items.append(line[2:])
        return items
    return "\n".join(_unescape(line) for _, line in body)


def from_markdown(spec: BlockSpec, text: str) -> BlockFields:
    """Parse and validate the Markdown form; every error gives the line and the reason."""
    lines = text.split("\n")
    start = _parse_front_matter(spec, lines)
    sections: dict[str, tuple[FieldSpec, int, list[tuple[int, str]]]] = {}
    current: list[tuple[int, str]] | None = None
    for index in range(start, len(lines)):
        number, line = index + 1, lines[index]
        if line.startswith("## "):
            field = _field_for_heading(spec, line[3:])
            if field is None:
                raise FormatError(
                    f"line {number}: unknown section {line[3:].strip()!r:.60} for block "
                    f"'{spec.label}'; its sections are {', '.join(f.title for f in spec.fields)}"
                )
            if field.name in sections:
                raise FormatError(f"line {number}: section '{field.title}' appears twice")
            current = []
            sections[field.name] = (field, number, current)
        elif current is not None:
            current.append((number, line))
        elif line.strip():
            raise FormatError(
                f"line {number}: text before the first '## Section' heading: {line!r:.60}"
            )
    raw: dict[str, object] = {}
    for name, (field, number, body) in sections.items():
        raw[name] = _section_value(field, body)
        if field.type is FieldType.ENUM and "\n" in str(raw[name]).strip():
            raise FormatError(f"line {number}: section '{field.title}' takes a single value")
    try:
        return validate_fields(spec, raw)
    except BlockValidationError as error:
        if error.field in sections:
            field, number, _ = sections[error.field]
            raise FormatError(f"line {number} (section '{field.title}'): {error}") from None
        raise FormatError(str(error)) from None


_MARKUP = frozenset("&<>")

ESCAPE_NOTE = (
    "In the memory below, &lt; &gt; and &amp; stand for the less-than, greater-than and "
    "ampersand characters; write the characters themselves when you quote memory in a tool "
    "call.\n"
)
"""Told to the model when a block's text was escaped, so it quotes values as they are."""


def escape_prompt_text(text: str) -> str:
    """`text` as it appears inside a prompt section: `&`, `<` and `>` as `&amp;`, `&lt;` and
    `&gt;` (XML's escaping, which models read as the characters).

    Why escape every one rather than neutralise only our own section tags: a block's text is
    untrusted (a user's repository, the model's own edits), and a list of tags to neutralise
    misses the next section name, a profile's new label, or tags the model reads as structure
    though we never wrote them (`<system>`, `<instructions>`). With `<` and `>` escaped no
    text can contain a tag at all, the prompt parses as XML into exactly our sections, and
    the escaping is a pure function of the text, so compiling twice gives the same bytes."""
    return html.escape(text, quote=False)


def render_prompt(spec: BlockSpec, fields: BlockFields) -> str:
    """One block in Letta's rendering (`<label>` with description, metadata and value); the
    texts escaped with `escape_prompt_text`, the char count that of the value itself."""
    value = render_value(spec, fields)
    metadata = [f"- chars_current={len(value)}", f"- chars_limit={spec.limit}"]
    if spec.read_only:
        metadata.append("- read_only=true")
    return (
        f"<{spec.label}>\n"
        f"<description>\n{escape_prompt_text(spec.description)}\n</description>\n"
        f"<metadata>\n" + "\n".join(metadata) + "\n</metadata>\n"
        f"<value>\n{escape_prompt_text(value)}\n</value>\n"
        f"</{spec.label}>"
    )


def render_memory(blocks: Mapping[str, tuple[BlockSpec, BlockFields]]) -> str:
    """All core memory blocks in Letta's `<memory_blocks>` section, with ESCAPE_NOTE when a
    block's text holds a character that was escaped."""
    rendered = "\n\n".join(render_prompt(spec, fields) for spec, fields in blocks.values())
    escaped = any(
        not _MARKUP.isdisjoint(text)
        for spec, fields in blocks.values()
        for text in (spec.description, render_value(spec, fields))
    )
    return (
        "<memory_blocks>\n"
        "The following memory blocks are currently engaged in your core memory unit:\n"
        + (ESCAPE_NOTE if escaped else "")
        + f"\n{rendered}\n\n"
        "</memory_blocks>"
    )
