"""The parts that wrap any scorer, turned on by a flag named after them, one file (or folder) each:
CriticalKV, ChunkKV, threshold eviction, chunk and block press, key re-rotation, ThinK's key-channel
pruning, the residual cache (ResKV). Their formulas, defaults and papers: ``docs/methods/switches.md`` and
``docs/methods/summaries.md``."""

from restkv.config.options import import_folder

#: ``from restkv.switches import <class>``: a part to give as a value
__getattr__ = import_folder(__name__, __path__, "switch")
