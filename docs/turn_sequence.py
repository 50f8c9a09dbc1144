"""Draws docs/turn-sequence.png, one turn in sequence (docs/architecture.md): `make docs-images`.

The diagram is data below (who, to whom, what); the drawing code only lays it out. matplotlib is
already a dependency (bench/plots.py); nothing runs this at test time.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PARTICIPANTS = [
    ("client", "client.py\nMemoryClient"),
    ("temporal", "Temporal\nserver"),
    ("workflow", "workflows/turn.py\nTurnWorkflow"),
    ("activities", "activities/turn.py\nTurnActivities"),
    ("domain", "memory/agent/steps.py\nTurnSteps (+ faces, tools)"),
    ("stores", "git repository ·\nSQL · archive"),
    ("model", "Claude\n(Messages API)"),
]

# (from, to, label) is a call; ("reply", from, to, label) an answer (dashed);
# ("note", first, last, label) a note across lifelines; ("section", label) a part of the turn.
STEPS: list[tuple[str, ...]] = [
    ("section", "1  the message and the reply: one update-with-start"),
    ("client", "temporal", "execute_update_with_start(TurnWorkflow, update=reply)"),
    ("temporal", "workflow", "run(TurnInput) — validated in @workflow.init"),
    ("workflow", "activities", "prepare_turn"),
    ("activities", "domain", "prepare: record the message; compile_context"),
    ("domain", "stores", "recall append (seq 0); blocks at HEAD; save the context"),
    ("note", "workflow", "model", "for step = 1 .. max_steps, while the model calls tools"),
    ("workflow", "activities", "call_model(step)"),
    ("activities", "domain", "call_model(step)"),
    ("domain", "model", "messages.create (a saved reply is reused on retry)"),
    ("reply", "model", "domain", "text + tool calls"),
    ("domain", "stores", "save the reply; recall append (the step's positions)"),
    ("workflow", "activities", "run_tools(step)"),
    ("activities", "domain", "run_tools: MemoryTools.execute: propose, archive, search"),
    ("domain", "stores", "PendingDiff rows (memory untouched); archive; recall"),
    ("workflow", "activities", "finish_turn → TurnSteps.finish: describe the proposed diffs"),
    ("reply", "workflow", "client", "reply Update returns TurnReply (text + pending diffs)"),
    ("section", "2  the human decision: a signal or the decide Update"),
    ("client", "temporal", "approve / reject signal, or decide Update"),
    ("temporal", "workflow", "validator refuses unknown or decided diffs; queued"),
    ("workflow", "activities", "decide(diff)"),
    ("activities", "domain", "approve: record the decision, then commit_approved"),
    ("domain", "stores", "git commit with Diff-Id trailer (or conflicted)"),
    ("reply", "workflow", "client", "DecisionOutcome: the real outcome, also to a race's loser"),
    ("note", "workflow", "stores", "no decision before approval_ttl: expire_diffs"),
    ("section", "3  rotation, when a committed block runs full"),
    ("workflow", "activities", "needs_rotation(user, label)"),
    ("workflow", "temporal", "start child RotationWorkflow (abandoned)"),
    ("note", "workflow", "stores", "plan_rotation → archive_rotation → commit_rotation"),
    ("reply", "workflow", "client", "TurnOutcome when every diff is decided or expired"),
]

OUT = Path(__file__).with_name("turn-sequence.png")


def draw(out: Path = OUT) -> None:
    column = {key: i for i, (key, _) in enumerate(PARTICIPANTS)}
    width, row = 2.05, 0.42
    rows = len(STEPS) + 1
    fig, ax = plt.subplots(figsize=(width * len(PARTICIPANTS) + 0.4, row * rows + 1.0))
    ax.set_xlim(-0.6, len(PARTICIPANTS) - 0.4)
    ax.set_ylim(rows + 0.2, -1.1)
    ax.axis("off")
    box = {"boxstyle": "round,pad=0.35", "fc": "#e8eefc", "ec": "#5a6b8c"}
    for key, label in PARTICIPANTS:
        x = column[key]
        ax.text(x, -0.45, label, ha="center", va="center", fontsize=8.5, bbox=box)
        ax.plot([x, x], [0.2, rows], color="#b0b8c8", lw=1, zorder=0)
    for y, step in enumerate(STEPS, start=1):
        if step[0] == "section":
            ax.text(-0.55, y, step[1], ha="left", va="center", fontsize=9, weight="bold")
            ax.axhline(y - 0.5, color="#dddddd", lw=0.8, zorder=0)
        elif step[0] == "note":
            first, last = column[step[1]], column[step[2]]
            ax.text(
                (first + last) / 2,
                y,
                step[3],
                ha="center",
                va="center",
                fontsize=8,
                style="italic",
                bbox={"boxstyle": "round,pad=0.3", "fc": "#fff4d6", "ec": "#d8c38a"},
            )
        else:
            back = step[0] == "reply"
            sender, receiver, label = step[1:] if back else step
            start, end = column[sender], column[receiver]
            ax.annotate(
                "",
                xy=(end, y + 0.12),
                xytext=(start, y + 0.12),
                arrowprops={
                    "arrowstyle": "-|>",
                    "color": "#7a869a" if back else "#34466b",
                    "lw": 1.1,
                    "linestyle": "--" if back else "-",
                },
            )
            ax.text((start + end) / 2, y - 0.08, label, ha="center", va="bottom", fontsize=7.8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw()
