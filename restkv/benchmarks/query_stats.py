"""``python -m restkv.benchmarks.query_stats``: the command's documented path (it lives in
``restkv.tools.query_stats``)."""

from restkv.tools.query_stats import main

if __name__ == "__main__":
    main()
