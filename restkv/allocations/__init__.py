"""How many tokens each row, layer and KV head keeps: one allocation a file, each registering itself.

Each allocation is a registered part (``--allocation <name>``) that owns its options;
``allocate(ctx, scores)`` is called once per compressed layer with the scorer's
``[B, H_kv, N]`` scores and returns the kept count per row and KV head, protected tokens
(the recent window) included (``base.Allocation``). Any scorer composes with any allocation.
``B = C - W`` is the row's candidate budget (``W`` = its protected tokens). A row whose
visible tokens fit in its budget keeps all of them, whatever the allocation. The counts are
ragged per head; the compressed cache stores each head's own (``restkv.cache.segments.ragged``).
Each allocation's formula, defaults and paper: ``docs/methods/allocations.md``.
"""

from restkv.config.options import import_folder

#: ``from restkv.allocations import <class>``: a part to give as a value
__getattr__ = import_folder(__name__, __path__, "allocation")
