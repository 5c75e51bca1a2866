"""Data: sources (packaged, data directory, local files, hub), partitioners, tokenized batches."""

from fedtune.data.partition import label_histograms, partition
from fedtune.data.sources import TextDataset, load_text_dataset, subsample

__all__ = ["TextDataset", "label_histograms", "load_text_dataset", "partition", "subsample"]
