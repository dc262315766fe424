"""The demo: a small real training job and a local launcher that plays the scheduler."""
