"""``python -m restkv.train_scorer``: the command's documented path (it lives in ``restkv.tools.train_scorer``)."""

from restkv.tools.train_scorer import main

if __name__ == "__main__":
    main()
