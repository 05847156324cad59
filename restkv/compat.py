"""The transformers releases restkv runs on, and the cache argument's name across them (``with_cache``,
``output_cache``): the public path of ``restkv.integrations.transformers.compat``."""

from restkv.integrations.transformers.compat import CACHE_ARGUMENT, check_transformers_version, output_cache, with_cache

__all__ = ["CACHE_ARGUMENT", "check_transformers_version", "output_cache", "with_cache"]
