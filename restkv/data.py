"""``python -m restkv.data NAME``: the command's documented path (it lives in ``restkv.benchmarks.downloads``)."""

from restkv.benchmarks.downloads import main

if __name__ == "__main__":
    main()
