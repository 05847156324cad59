"""How the compressed cache stores its kept tokens as codes, one ``--quant_method`` a file, each registering
itself (the codes and their segment: ``restkv.cache.segments.quantized``; the formulas:
``docs/methods/quantization.md``)."""

from restkv.config.options import import_folder

#: ``from restkv.quantizers import <class>``: a part to give as a value
__getattr__ = import_folder(__name__, __path__, "quantization")
