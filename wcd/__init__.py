"""wcd: a GPU weight cache daemon.

The daemon keeps model weights resident (GPU memory, or host memory without a GPU) and hands
them to engines zero-copy over a Unix socket. This package root imports nothing heavy: the
daemon and wcdctl must start fast and never import torch.
"""

__version__ = "0.1.0"
# The name pip knows wcd by (PyPI's "wcd" is another project); the import package is `wcd`.
DISTRIBUTION = "wcd-weight-cache"
# The device name of host memory (configs, keys, arenas); GPUs are "cuda:N" or a GPU UUID.
HOST_DEVICE = "cpu"
