"""Adapters for the trainers people use: each a thin layer over ``ResilientRun``.

``trainers.accelerate``: an ``Accelerator`` loop.
``trainers.hf``: a ``transformers.Trainer`` script (``ResilientTrainer``).
``trainers.lightning``: a ``LightningModule`` trained by ``Trainer.fit`` (``ResilientCallback``).
Each module imports its library lazily, so ``import kempner_resilience`` works without them
(the ``accelerate``, ``hf`` and ``lightning`` extras install them).
"""
