"""Block schemas as declared by agent profiles, and the built-in kinds from the seed
000_d8598551964ab573.txt."""

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from durable_memory.models.limits import MAX_BLOCK_CHARS

FieldValue = str | list[str] | None
BlockFields = dict[str, FieldValue]
"""A block's content: field name -> value. Text blocks have the single field `value`."""

FieldName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,47}$")]


class FieldType(StrEnum):
    TEXT = "text"
    """Free, multi-line text (the single field of a Letta-style text block)."""
    STR = "str"
    LIST = "list[str]"
    ENUM = "enum"


class BlockKind(StrEnum):
    TEXT = "text"
    """Letta-style free text (`persona`, `human`)."""
    FIELDS = "fields"
    """Typed fields declared in the profile (`student`, `journey`, ... in the seed
    000_d8598551964ab573.txt)."""
    PERSONA = "persona"
    """The built-in PersonaBlock of the seed 000_d8598551964ab573.txt."""
    HUMAN = "human"
    """The built-in HumanBlock of the seed 000_d8598551964ab573.txt."""


class RotationStrategyName(StrEnum):
    AGGRESSIVE = "aggressive"
    PRESERVATIVE = "preservative"
    ADAPTIVE = "adaptive"


class FieldSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: FieldName
    type: FieldType
    description: str = ""
    required: bool = False
    max_items: int | None = Field(default=None, gt=0)
    choices: tuple[str, ...] | None = None
    default: FieldValue = None

    @property
    def title(self) -> str:
        """The Markdown heading of this field: `current_task` -> `Current Task`."""
        return " ".join(part.capitalize() for part in self.name.split("_"))


class BlockSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    label: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,47}$")]
    description: str
    limit: int = Field(gt=0, le=MAX_BLOCK_CHARS)
    read_only: bool = False
    never_pre_approved: bool = False
    """No standing approval may cover this block: every edit of it waits for a person."""
    rotation: RotationStrategyName = RotationStrategyName.ADAPTIVE
    kind: BlockKind
    fields: tuple[FieldSpec, ...]
    default: BlockFields = Field(default_factory=dict)

    def field(self, name: str) -> FieldSpec | None:
        return next((f for f in self.fields if f.name == name), None)


class SessionState(StrEnum):
    """The HumanBlock session states of the seed 000_d8598551964ab573.txt."""

    IDLE = "idle"
    ACTIVE_TASK = "active_task"
    WAITING_INPUT = "waiting_input"
    THINKING = "thinking"
    ERROR_RECOVERY = "error_recovery"


class PersonaSettings(BaseModel):
    """Who the agent is. The instructions are the system prompt's fixed part: the agent cannot
    edit them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    role: str = Field(min_length=1)
    instructions: str = Field(min_length=1)


class ModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "claude-sonnet-4-6"
    max_tokens: int = Field(default=1024, gt=0, le=64_000)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    """Sent only when set: the API deprecated it, and newer models refuse non-default values."""
    context_window: int = Field(default=200_000, gt=0)
    cache_ttl: Literal["5m", "1h", "off"] = "5m"
    """The TTL of the prompt-cache breakpoints each request carries ("off": none). 1 hour
    costs 2x per cache write instead of 1.25x, and pays when turns are more than 5 minutes
    apart (docs/context-and-tools.md)."""
    memory_delta: bool = True
    """Keep the system prompt's memory blocks as they were at the prompt base and send the
    blocks changed since as a memory update in the newest user turn, until re-compiling is
    cheap (the cache is cold, a new summary) or the update too large; False: every turn
    shows HEAD's blocks in the system prompt, so an approval rewrites the cached conversation
    (docs/context-and-tools.md#the-prompt-base-and-the-memory-update)."""
    memory_delta_max_share: float = Field(default=0.5, gt=0.0)
    """The memory update may take at most this share of the system prompt's memory blocks'
    tokens; a larger one moves the base to HEAD (re-compiles the blocks)."""


class ToolSet(StrEnum):
    """How the model edits its memory blocks (a profile's `tools`; every set also gets
    archival memory and conversation search)."""

    LETTA = "letta"
    """Letta-style tools: core_memory_append, core_memory_replace, memory_insert,
    memory_rethink, edit_memory_block."""
    CLAUDE_MEMORY = "claude_memory"
    """Claude's memory tool (`memory_20250818`) over `/memories`, one Markdown file a block."""


class AgentProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    persona: PersonaSettings
    model: ModelSettings = ModelSettings()
    tools: tuple[ToolSet, ...] = (ToolSet.LETTA,)
    """The tool sets the model gets (one or both); the tools are offered in a fixed order."""
    blocks: tuple[BlockSpec, ...]

    @field_validator("tools")
    @classmethod
    def _one_of_each(cls, tools: tuple[ToolSet, ...]) -> tuple[ToolSet, ...]:
        if not tools or len(set(tools)) != len(tools):
            raise ValueError(
                f"list each tool set once, at least one of {', '.join(t.value for t in ToolSet)}"
            )
        return tools

    def block(self, label: str) -> BlockSpec | None:
        return next((b for b in self.blocks if b.label == label), None)
