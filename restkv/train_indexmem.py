"""``python -m restkv.train_indexmem``: the command's documented path (it lives in ``restkv.tools.train_indexmem``)."""

from restkv.tools.train_indexmem import main

if __name__ == "__main__":
    main()
