"""Benchmark data, prompts, generation loops and metrics.

The top-level run_*.py and eval*.py are thin command lines over these modules: the adapters
(``longbench``, ``ruler`` with ``ruler_data``, ``needle`` with ``haystack``, ``infinitebench``)
each fill one ``benchmark.Benchmark``; ``runner`` runs one (``flags``, ``run_folder`` and
``results``, ``prompts``, ``session``) and ``scoring`` scores its run folders; ``sweep`` is the
README's budget sweep.
"""
