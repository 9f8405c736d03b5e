"""Checkpoints: readers of HF and colozoo directories, the loader, the colozoo index, conversion,
collective saving, HF export, atomic writes."""
