"""Per-family maps between HF names/layouts and ours, and loading HF weights into a sharded model."""
from .load import family_module, load_hf_weights, hf_tensor_names
from .sources import CheckpointError, GlobalTensor, SafetensorsReader, Source, StateDictReader, TensorReader
