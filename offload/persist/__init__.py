"""Persistence: an engine's state and a model's weights to files and back. Nothing here imports the engine: an
engine is an :class:`offload._state.EngineState`, and only that contract is read or written.

Checkpoints (``engine.save_checkpoint`` / ``load_checkpoint``: crash-safe, one shard per rank, resharded on load):

* ``_format``: a checkpoint's layout on disk, the rule for tags, and ``TensorFile`` (raw tensor bytes at
  page-aligned offsets, each write checksummed in its index);
* ``_entries``: an engine's tensors as a checkpoint names them (``param/``, ``exp_avg/``, ``frozen/`` ...), and
  where each sub-group's block holds their pieces;
* ``_save``: the collective save and its commit protocol (temporary folder, ``meta.json``, rename, ``latest``),
  the client state's check, and the removal of what killed saves left;
* ``_reader``: ``Checkpoint``, a tag's folder opened for reads re-cut across any number of shards; ``committed``;
* ``_restore``: a checkpoint loaded into a running engine (whole, or DeepSpeed's partial loads).

Weights (the ecosystem's files):

* ``_tensors``: a live engine's tensors as host tensors (fp32 masters gathered over ranks): what
  ``consolidated_state_dict`` and the exports read;
* ``_export``: safetensors out, sharded with an index, one shard in RAM at a time (from an engine or a
  checkpoint), DeepSpeed's ``save_16bit_model``, and a checkpoint as one torch file;
* ``_load``: ``offload.load_state_dict``: safetensors / torch checkpoints streamed into a model or an engine;
* ``_convert``: transformers' layout conversions, applied as a checkpoint streams in and reverted as an export
  streams out.

``_durable`` is the one place files are written durably (fsync, temporary name and rename, the folder fsynced,
owner records), for checkpoints and exports alike.
"""

from ._convert import buffers_from_pretrained_keeps
from ._durable import make_folder
from ._export import export, save_16bit, save_checkpoint_folder, save_engine
from ._load import LoadResult, keys_by_tensor, load_into_engine, load_state_dict
from ._reader import committed
from ._restore import load
from ._save import save
from ._tensors import consolidated_state_dict, engine_tensors

__all__ = ["LoadResult", "buffers_from_pretrained_keeps", "committed", "consolidated_state_dict", "engine_tensors",
           "export", "keys_by_tensor", "load", "load_into_engine", "load_state_dict", "make_folder", "save",
           "save_16bit", "save_checkpoint_folder", "save_engine"]
