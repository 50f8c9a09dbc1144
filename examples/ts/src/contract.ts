/**
 * durable-memory's turn workflow as a TypeScript caller sees it, written from the published
 * JSON Schemas (schemas/*.json in the repository) and docs/integration.md.
 *
 * Every payload is a plain JSON object: the default data converter is all a caller needs.
 */

/** The workflow type to start. */
export const TURN_WORKFLOW = 'TurnWorkflow';

/** The Update that returns the reply; send it with update-with-start. */
export const REPLY_UPDATE = 'reply';
/** The Update that decides one diff and returns what became of it. */
export const DECIDE_UPDATE = 'decide';
/** One of the turn's diffs, by id: its status, outcome and preview. */
export const DIFF_QUERY = 'diff';
/** Fire-and-forget decisions, accepted while no worker runs. */
export const APPROVE_SIGNAL = 'approve';
export const REJECT_SIGNAL = 'reject';

/** One workflow per (user, turn); neither id may contain ':'. */
export function turnWorkflowId(userId: string, turnId: string): string {
  return `turn:${userId}:${turnId}`;
}

/** The `type` of the ApplicationFailure a caller gets; see docs/integration.md. */
export type ErrorType =
  | 'InvalidInput'
  | 'TurnFailed'
  | 'UnknownDiff'
  | 'DiffAlreadyDecided'
  | 'DecisionRefused';

/** schemas/TurnInput.json: only what the caller decides; the rest is the worker's. */
export interface TurnInput {
  user_id: string;
  turn_id: string;
  message: string;
  /** Optional: fewer model calls than the worker's `memory.max_steps` (never more). */
  max_steps?: number;
  /** Optional: a shorter approval wait than the worker's `turn.approval_ttl_s` (never longer). */
  approval_ttl_s?: number;
  /** Optional, for a user's first turn: the agent profile the user keeps. */
  profile?: string;
}

export type DiffStatus =
  | 'pending'
  | 'approved'
  | 'rejected'
  | 'expired'
  | 'superseded'
  | 'conflicted';

/** schemas/SignalledDecision.json: the `approve` and `reject` signals' payload (the signal's
 * name is the decision). */
export interface SignalledDecision {
  diff_id: string;
  approver: string;
  reason?: string | null;
  /** An approval only: the block as the reviewer edited it (its Markdown form). */
  edited_markdown?: string | null;
  /** Optional: the turn knows its user; if given it must be the turn's. */
  user_id?: string;
}

/** schemas/DiffDecision.json: the `decide` Update's payload. */
export interface DiffDecision extends SignalledDecision {
  decision: 'approve' | 'reject';
}

export interface ProposedDiff {
  id: string;
  label: string;
  summary: string;
  status: DiffStatus;
}

/** schemas/TurnReply.json: what the `reply` Update returns. */
export interface TurnReply {
  user_id: string;
  turn_id: string;
  workflow_id: string;
  reply: string;
  diffs: ProposedDiff[];
  stopped_at_step_limit: boolean;
}

/** schemas/DecisionOutcome.json: what the `decide` Update returns, and the details of a
 * DiffAlreadyDecided failure (the decision that won). */
export interface DecisionOutcome {
  diff_id: string;
  status: DiffStatus;
  commit_sha: string | null;
  message: string;
  label: string | null;
  decided_by: string | null;
  decided_at: string | null;
  /** The human decision that settled it; null for an expired or superseded diff. */
  decision: 'approve' | 'reject' | null;
}

/** schemas/DiffView.json: what the `diff` query answers for one of the turn's diffs. */
export interface DiffView {
  diff_id: string;
  user_id: string;
  turn_id: string;
  workflow_id: string;
  label: string;
  summary: string;
  status: DiffStatus;
  outcome: DecisionOutcome | null;
  preview_markdown: string;
}

/** schemas/TurnOutcome.json: the workflow's result. */
export interface TurnOutcome {
  turn_id: string;
  reply: string;
  decisions: DecisionOutcome[];
  status: 'replying' | 'awaiting_approval' | 'committing' | 'done' | 'expired' | 'failed';
}
