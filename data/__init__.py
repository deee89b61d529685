"""Token batches for training: corpora, tokenizer, packing and the rank-sharded loader.

Every loader follows the `BatchLoader` protocol in `data.loader`; `build_loader` picks one from the
`data` config group (`name` key).
"""

from data.loader import BatchLoader, batch_to_device, build_loader, build_loaders

__all__ = ["BatchLoader", "batch_to_device", "build_loader", "build_loaders"]
