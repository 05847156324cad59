"""Merging evicted tokens into kept ones after selection, one ``--merge`` a file (and CaM's value merging,
which ``--method cam`` applies), each registering itself."""

from restkv.config.options import import_folder

import_folder(__name__, __path__)
