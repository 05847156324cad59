"""``python -m restkv.benchmarks.duo_pattern``: the command's documented path (it lives in
``restkv.tools.duo_pattern``)."""

from restkv.tools.duo_pattern import main

if __name__ == "__main__":
    main()
