"""Workflows for the sandbox's tests, in a module that imports temporalio alone, so the default
sandbox can import it afresh in each run: one calls what the sandbox forbids at run time
(`open`), one makes payloads of each kind the worker visits with a context."""

from datetime import timedelta

from temporalio import workflow


@workflow.defn(sandboxed=True)
class OpensAFile:
    @workflow.run
    async def run(self) -> str:
        with open(__file__, encoding="utf-8") as source:
            return source.readline()


@workflow.defn(sandboxed=True)
class SchedulesAndUpserts:
    """Payloads of each kind the worker visits with a context: an activity's argument and
    result, a local activity's, a memo upsert, the workflow's own result."""

    @workflow.run
    async def run(self, word: str) -> str:
        remote = await workflow.execute_activity(
            "shout", word, start_to_close_timeout=timedelta(seconds=30)
        )
        local = await workflow.execute_local_activity(
            "shout", remote, start_to_close_timeout=timedelta(seconds=30)
        )
        workflow.upsert_memo({"said": local})
        return f"{local}!"
