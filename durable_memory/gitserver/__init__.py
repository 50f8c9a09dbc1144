"""`dmem git-serve`: a smart-HTTP git server for the distributed mode, and its pre-receive hook."""
