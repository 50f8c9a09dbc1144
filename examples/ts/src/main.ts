/**
 * A backend in TypeScript driving one durable-memory turn with @temporalio/client and the
 * default JSON converter (docs/integration.md):
 *
 *   1. update-with-start: start the turn and get its reply in one call
 *   2. approve the first proposed diff by signal (fire-and-forget)
 *   3. a late `decide` on that same diff: refused with DiffAlreadyDecided, naming the winner
 *   4. reject the second diff by the `decide` Update (returns the outcome)
 *   5. the workflow's result: what became of every diff, and the `diff` query for one
 *   6. a bad input: refused with InvalidInput, naming the field
 *
 * Configuration (environment): TEMPORAL_ADDRESS (default localhost:7233), TEMPORAL_NAMESPACE
 * (default "default"), DMEM_TASK_QUEUE (default "durable-memory"), DMEM_USER, DMEM_TURN.
 * Prints one JSON line per step; exits 1 at the first step that is not as expected.
 */
import {
  ApplicationFailure,
  Client,
  Connection,
  WithStartWorkflowOperation,
  Workflow,
  WorkflowUpdateFailedError,
} from '@temporalio/client';

import {
  APPROVE_SIGNAL,
  DECIDE_UPDATE,
  DIFF_QUERY,
  DecisionOutcome,
  DiffDecision,
  DiffView,
  ErrorType,
  REPLY_UPDATE,
  SignalledDecision,
  TURN_WORKFLOW,
  TurnInput,
  TurnOutcome,
  TurnReply,
  turnWorkflowId,
} from './contract';

const address = process.env.TEMPORAL_ADDRESS ?? 'localhost:7233';
const namespace = process.env.TEMPORAL_NAMESPACE ?? 'default';
const taskQueue = process.env.DMEM_TASK_QUEUE ?? 'durable-memory';
const userId = process.env.DMEM_USER ?? 'alice';
const turnId = process.env.DMEM_TURN ?? `ts-${Date.now()}`;
const approver = 'ms-rivera';

function report(step: string, value: unknown): void {
  console.log(JSON.stringify({ step, value }));
}

function check(condition: boolean, what: string): asserts condition {
  if (!condition) {
    throw new Error(`unexpected: ${what}`);
  }
}

/** The named failure behind an Update's refusal: its `type` is the contract. */
function refusal(error: unknown): ApplicationFailure {
  if (error instanceof WorkflowUpdateFailedError && error.cause instanceof ApplicationFailure) {
    return error.cause;
  }
  throw error;
}

/** Start the turn (or join it, if this turn id was sent before) and wait for its reply. */
async function sendMessage(client: Client, input: TurnInput): Promise<TurnReply> {
  const start = new WithStartWorkflowOperation(TURN_WORKFLOW, {
    workflowId: turnWorkflowId(input.user_id, input.turn_id),
    taskQueue,
    args: [input],
    workflowIdConflictPolicy: 'USE_EXISTING',
  });
  return client.workflow.executeUpdateWithStart<Workflow, TurnReply, []>(REPLY_UPDATE, {
    startWorkflowOperation: start,
  });
}

async function expectRefusal(what: string, named: ErrorType, call: () => Promise<unknown>) {
  try {
    await call();
  } catch (error) {
    const failure = refusal(error);
    report(what, { type: failure.type, message: failure.message, details: failure.details });
    check(failure.type === named, `${what}: ${failure.type} instead of ${named}`);
    return failure;
  }
  throw new Error(`unexpected: ${what} was accepted`);
}

async function main(): Promise<void> {
  const connection = await Connection.connect({ address });
  const client = new Client({ connection, namespace });
  try {
    // 1. The reply, in the call that starts the turn.
    const reply = await sendMessage(client, {
      user_id: userId,
      turn_id: turnId,
      message: "Hi, I'm Alice and I'm drafting my essay",
    });
    report('reply', reply);
    check(reply.diffs.length === 2, `two proposed diffs, got ${reply.diffs.length}`);
    const [first, second] = reply.diffs;
    const handle = client.workflow.getHandle(reply.workflow_id);

    // 2. Approve by signal: returns once Temporal has recorded it, before it is applied.
    const approval: SignalledDecision = { diff_id: first.id, approver };
    await handle.signal(APPROVE_SIGNAL, approval);
    report('approve signal sent', first.id);

    // 3. A decision that comes after another on the same diff loses, whichever way it was
    //    sent, and is told who won and with which commit.
    const late: DiffDecision = { diff_id: first.id, decision: 'reject', approver: 'latecomer' };
    const lost = await expectRefusal('late decide', 'DiffAlreadyDecided', () =>
      handle.executeUpdate(DECIDE_UPDATE, { args: [late] }),
    );
    const winner = (lost.details ?? [])[0] as DecisionOutcome;
    check(winner.status === 'approved' && winner.decided_by === approver, 'the signal won');

    // 4. Reject by Update: returns when the decision is recorded.
    const rejection: DiffDecision = {
      diff_id: second.id,
      decision: 'reject',
      approver,
      reason: 'too early to say',
    };
    const rejected = await handle.executeUpdate<DecisionOutcome, [DiffDecision]>(DECIDE_UPDATE, {
      args: [rejection],
    });
    report('decide', rejected);
    check(rejected.status === 'rejected', `rejected, got ${rejected.status}`);

    // 5. Every diff decided: the turn ends with what became of each.
    const outcome: TurnOutcome = await handle.result();
    report('result', outcome);
    const statuses = Object.fromEntries(outcome.decisions.map((d) => [d.diff_id, d.status]));
    check(statuses[first.id] === 'approved' && statuses[second.id] === 'rejected', 'outcomes');
    const committed = outcome.decisions.find((d) => d.diff_id === first.id);
    check(Boolean(committed?.commit_sha), 'the approval names its commit');

    // A diff, by id, from its turn: a query still answers after the turn has ended.
    const view = await handle.query<DiffView, [string]>(DIFF_QUERY, first.id);
    report('diff query', view);
    check(view.outcome?.decision === 'approve', 'the diff query names the decision');

    // 6. A bad input is refused by the workflow itself, naming the field.
    const bad = { user_id: userId, turn_id: `${turnId}-bad`, message: '', colour: 'red' };
    const invalid = await expectRefusal('bad input', 'InvalidInput', () =>
      sendMessage(client, bad as TurnInput),
    );
    check(invalid.message.includes('colour'), 'InvalidInput names the unknown field');
  } finally {
    await connection.close();
  }
}

main().catch((error: unknown) => {
  console.error(error instanceof Error ? error.message : error);
  process.exit(1);
});
