"""``python -m restkv.benchmarks.head_scores``: the command's documented path (it lives in
``restkv.tools.head_scores``)."""

from restkv.tools.head_scores import main

if __name__ == "__main__":
    main()
