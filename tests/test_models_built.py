"""Every pydantic model of ours is complete once its module is imported: a model left
incomplete (a forward reference resolved only later) still validates, but each TypeAdapter of
it generates its schema again, and temporalio's pydantic converter builds one per payload it
decodes (its adapter cache lives per converter, and the SDK makes a converter per workflow
activation and per client call): ~0.45 ms for every TurnReply a caller received."""

import importlib
import inspect
import pkgutil

from pydantic import BaseModel, TypeAdapter

import durable_memory
from durable_memory.models.turn import TurnReply


def test_every_model_of_ours_is_built_at_import() -> None:
    incomplete = []
    for info in pkgutil.walk_packages(durable_memory.__path__, "durable_memory."):
        module = importlib.import_module(info.name)
        incomplete += [
            f"{module.__name__}.{name}"
            for name, value in vars(module).items()
            if inspect.isclass(value)
            and issubclass(value, BaseModel)
            and value.__module__ == module.__name__
            and not value.__pydantic_complete__
        ]
    assert incomplete == [], "call model_rebuild() once what they refer to is defined"


def test_a_type_adapter_of_a_built_model_reuses_its_schema() -> None:
    """What the first test protects, seen without a clock: the adapter takes the model's own
    core schema instead of generating one."""
    adapter = TypeAdapter(TurnReply)
    assert adapter.core_schema is TurnReply.__pydantic_core_schema__
