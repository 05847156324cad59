"""How the compressed cache stores its kept tokens as codes, one ``--quant_method`` a file, each registering
itself (the codes and their segment: ``restkv.cache.segments.quantized``)."""

from restkv.config.options import import_folder

import_folder(__name__, __path__)
