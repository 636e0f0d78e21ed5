"""fsd inside the training frameworks users run, one optional module each.

- :mod:`fsd.integrations.lightning`: :class:`~fsd.integrations.lightning.FSDCallback`, a
  Lightning callback that adds a :class:`fsd.ContinualRegularizer`'s penalty to every training
  step (``pip install "fsd[lightning]"``).

The core library never imports these modules; each imports its framework.
"""
