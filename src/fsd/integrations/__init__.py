"""fsd inside the training frameworks users run, one optional module each.

- :mod:`fsd.integrations.lightning`: :class:`~fsd.integrations.lightning.FSDCallback`, a
  Lightning callback that adds a :class:`fsd.ContinualRegularizer`'s penalty to every training
  step (``pip install "fsd[lightning]"``).
- :mod:`fsd.integrations.transformers`: :class:`~fsd.integrations.transformers.FSDTrainer`, a
  Hugging Face ``Trainer`` whose training loss carries the penalty
  (``pip install "fsd[transformers]"``).

The core library never imports these modules; each imports its framework.
"""
