"""Merging evicted tokens into kept ones after selection, one ``--merge`` a file (and CaM's value merging,
which ``--method cam`` applies), each registering itself. Their formulas and papers: ``docs/methods/merges.md``."""

from restkv.config.options import import_folder

#: ``from restkv.merges import <class>``: a part to give as a value
__getattr__ = import_folder(__name__, __path__, "merge")
