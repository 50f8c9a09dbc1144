"""What the model sees and does: the context compiler, token counting, the tools, the model
adapter, the turn steps."""
