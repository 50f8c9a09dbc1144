"""Agent profiles: TOML files declaring the persona, the model settings and the memory blocks;
the catalog of the profiles one deployment serves; and the record in a user's repository that
names the user's profile (`profile.toml`)."""

import re
import threading
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from durable_memory.memory.core.blocks import BUILTIN_FIELDS, default_fields
from durable_memory.memory.core.errors import BlockValidationError, ProfileError
from durable_memory.memory.core.personas import PERSONA_PRESETS
from durable_memory.models.blocks import AgentProfile, BlockKind, BlockSpec, FieldType

PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""A profile's name in the catalog and in a user's record: a bundled file's stem
(`essay_coach`), or a configured file's."""


def _bundled_names() -> tuple[str, ...]:
    """The profiles shipped in `durable_memory/profiles/`, by file stem."""
    folder = resources.files("durable_memory.profiles")
    stems = (e.name.removesuffix(".toml") for e in folder.iterdir() if e.name.endswith(".toml"))
    return tuple(sorted(stem for stem in stems if PROFILE_NAME.fullmatch(stem)))


BUNDLED_PROFILES = _bundled_names()


def _pydantic_problem(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def _block_spec(source: str, index: int, raw: object) -> BlockSpec:
    if not isinstance(raw, dict):
        raise ProfileError(f"{source}: blocks[{index}] must be a table")
    label = raw.get("label")
    name = f"block {label!r:.60}" if isinstance(label, str) else f"blocks[{index}]"
    fail = f"{source}: {name}:"
    data: dict[str, Any] = dict(raw)
    kind = data.get("kind", BlockKind.TEXT.value)
    if kind not in {k.value for k in BlockKind}:
        raise ProfileError(
            f"{fail} unknown kind {kind!r}; use one of {', '.join(k.value for k in BlockKind)}"
        )
    data["kind"] = kind
    preset = data.pop("preset", None)
    if BlockKind(kind) in BUILTIN_FIELDS:
        if "fields" in data:
            raise ProfileError(f"{fail} kind '{kind}' has built-in fields; remove 'fields'")
        data["fields"] = BUILTIN_FIELDS[BlockKind(kind)]()
    elif not data.get("fields"):
        raise ProfileError(f"{fail} kind 'fields' needs at least one [[blocks.fields]] entry")
    if preset is not None:
        if kind != BlockKind.PERSONA.value or preset not in PERSONA_PRESETS:
            raise ProfileError(
                f"{fail} preset {preset!r} is not one of {', '.join(PERSONA_PRESETS)} "
                "(presets apply to kind 'persona')"
            )
        data["default"] = {**PERSONA_PRESETS[preset], **data.get("default", {})}
    for field in data["fields"]:
        if isinstance(field, dict) and field.get("type") not in {t.value for t in FieldType}:
            raise ProfileError(
                f"{fail} field {field.get('name')!r} has unknown type {field.get('type')!r}; "
                f"use one of {', '.join(t.value for t in FieldType)}"
            )
    try:
        spec = BlockSpec.model_validate(data)
    except ValidationError as error:
        raise ProfileError(f"{fail} {_pydantic_problem(error)}") from None
    _check_fields(fail, spec)
    try:
        default_fields(spec)
    except BlockValidationError as error:
        raise ProfileError(f"{fail} its default is invalid: {error}") from None
    return spec


def _check_fields(fail: str, spec: BlockSpec) -> None:
    seen: set[str] = set()
    for field in spec.fields:
        if field.name in seen:
            raise ProfileError(f"{fail} field '{field.name}' is declared twice")
        seen.add(field.name)
        if field.type is FieldType.ENUM and not field.choices:
            raise ProfileError(f"{fail} enum field '{field.name}' needs non-empty 'choices'")
        if field.type is not FieldType.ENUM and field.choices is not None:
            raise ProfileError(f"{fail} field '{field.name}': only enum fields take 'choices'")
        if field.type is not FieldType.LIST and field.max_items is not None:
            raise ProfileError(f"{fail} field '{field.name}': only list fields take 'max_items'")
        if field.type is FieldType.TEXT and spec.kind is BlockKind.FIELDS:
            raise ProfileError(
                f"{fail} field '{field.name}': type 'text' is for kind 'text' blocks; use 'str'"
            )


def parse_profile(text: str, source: str) -> AgentProfile:
    """Parse and check a profile; every problem is a ProfileError naming `source` and the block."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ProfileError(f"{source}: not valid TOML: {error}") from None
    blocks_raw = raw.get("blocks")
    if not isinstance(blocks_raw, list) or not blocks_raw:
        raise ProfileError(f"{source}: declares no memory blocks (add [[blocks]] tables)")
    blocks = [_block_spec(source, i, b) for i, b in enumerate(blocks_raw)]
    labels: set[str] = set()
    for spec in blocks:
        if spec.label in labels:
            raise ProfileError(f"{source}: block '{spec.label}': label declared twice")
        labels.add(spec.label)
    unknown = sorted(set(raw) - {"name", "persona", "model", "tools", "blocks"})
    if unknown:
        raise ProfileError(f"{source}: unknown top-level key(s) {', '.join(unknown)}")
    try:
        return AgentProfile.model_validate({**raw, "blocks": blocks})
    except ValidationError as error:
        raise ProfileError(f"{source}: {_pydantic_problem(error)}") from None


def load_profile(path: str | Path) -> AgentProfile:
    """Load a profile from a file path, or a bundled profile by name (see BUNDLED_PROFILES)."""
    if str(path) in BUNDLED_PROFILES:
        resource = resources.files("durable_memory.profiles") / f"{path}.toml"
        return parse_profile(resource.read_text(encoding="utf-8"), f"bundled profile {path}")
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(f"{file}: cannot read profile: {error}") from None
    return parse_profile(text, str(file))


class ProfileCatalog:
    """The profiles one deployment serves, by name: every bundled one, and the configured one
    (a bundled name, a file, or a profile given as it is), which is also the default for a
    user who has none recorded. Each is loaded once, when first asked for; thread-safe."""

    def __init__(self, configured: AgentProfile | str | Path = "default") -> None:
        self._loaded: dict[str, AgentProfile] = {}
        self._lock = threading.Lock()
        if isinstance(configured, AgentProfile):
            self.default_name = configured.name
            self._loaded[configured.name] = configured
        elif str(configured) in BUNDLED_PROFILES:
            self.default_name = str(configured)
        else:  # a file: loaded now, so a bad one stops the deployment at start
            self.default_name = Path(configured).stem
            self._loaded[self.default_name] = load_profile(configured)
        if not PROFILE_NAME.fullmatch(self.default_name):
            raise ProfileError(
                f"profile name {self.default_name!r} (from {configured!s:.80}) must match "
                f"{PROFILE_NAME.pattern}"
            )

    def names(self) -> list[str]:
        return sorted({*BUNDLED_PROFILES, *self._loaded})

    @property
    def default(self) -> AgentProfile:
        return self.get(self.default_name)

    def get(self, name: str) -> AgentProfile:
        """The profile called `name` (its catalog name, or the `name` its file declares, e.g.
        `essay-coach` for `essay_coach`); an unknown name is one ProfileError listing the
        known ones."""
        with self._lock:
            found = self._loaded.get(name)
        if found is not None:
            return found
        if name in BUNDLED_PROFILES:
            loaded = load_profile(name)
            with self._lock:
                return self._loaded.setdefault(name, loaded)
        declared = (self.get(known) for known in self.names())
        found = next((profile for profile in declared if profile.name == name), None)
        if found is None:
            raise ProfileError(
                f"unknown profile {name!r:.80}; the known profiles are {', '.join(self.names())}"
            )
        return found

    def describe(self, name: str) -> str:
        """One line: the persona's role and the blocks."""
        profile = self.get(name)
        labels = ", ".join(block.label for block in profile.blocks)
        return f"{profile.persona.role} (blocks: {labels})"


_RECORD_FORM = '`name = "<profile>"`'


def profile_record(name: str) -> str:
    """The text of a user's `profile.toml`, naming profile `name`."""
    if not PROFILE_NAME.fullmatch(name):
        raise ProfileError(f"profile name {name!r:.80} must match {PROFILE_NAME.pattern}")
    return f'name = "{name}"\n'


def read_profile_record(text: str, where: str) -> str:
    """The profile name a user's `profile.toml` holds; anything else (not TOML, other keys, a
    name that cannot be a profile's) is one ProfileError naming `where`."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        problem = f"not valid TOML ({error})"
    else:
        name = raw.get("name")
        if set(raw) != {"name"}:
            problem = f"holds the key(s) {', '.join(sorted(raw)) or 'none'}"
        elif not isinstance(name, str):
            problem = f"its name is {name!r:.80}, not a string"
        elif not PROFILE_NAME.fullmatch(name):
            problem = f"names {name!r:.80}, which is not a profile name"
        else:
            return name
    raise ProfileError(
        f"{where}: {problem}; it must hold only {_RECORD_FORM} (change a user's profile with "
        "`dmem profile set`)"
    )
