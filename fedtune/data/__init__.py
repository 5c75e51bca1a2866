"""Data: sources (packaged sets, a data directory, local files, the hub), partitioners, batches.

Modules import no model code; each task (``fedtune/tasks/``) combines a source with its model.
"""
