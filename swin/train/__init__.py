"""The training loop of train.py and what it needs: setup, step, run state, checkpoints, guard, DDP."""
