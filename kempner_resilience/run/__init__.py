"""The run a training script holds: ResilientRun, its set-up sequence, its state."""
