"""What a compression run is: typed options (``options``: each a flag with its help, type and range,
and the registry of parts), the composition of one run from its parts (``composition``), and the
command-line flags built from the same declarations (``flags``)."""

from restkv.config.composition import (OBSERVATIONS, RECONSTRUCTION_CHUNK, RECONSTRUCTION_REDUCTIONS, CompressionConfig,
                                       ModelShape, RunOptions, config_from_spec, flat_option_specs, kept_at_ratio,
                                       method_spec_options, option_names)
from restkv.config.options import ConfigError

__all__ = ["OBSERVATIONS", "RECONSTRUCTION_CHUNK", "RECONSTRUCTION_REDUCTIONS", "CompressionConfig", "ConfigError",
           "ModelShape", "RunOptions", "config_from_spec", "flat_option_specs", "kept_at_ratio", "method_spec_options",
           "option_names"]
