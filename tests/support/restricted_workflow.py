"""A workflow that calls what the sandbox forbids at run time (`open`), in a module that
imports temporalio alone, so the default sandbox can import it afresh in each run."""

from temporalio import workflow


@workflow.defn(sandboxed=True)
class OpensAFile:
    @workflow.run
    async def run(self) -> str:
        with open(__file__, encoding="utf-8") as source:
            return source.readline()
